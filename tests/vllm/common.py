"""Shared by the real-vLLM tests: the server environment and process bookkeeping."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
"""1 GiB of KV cache (plenty for the tiny model) and no hub lookups."""


def vllm_launch_overrides(vllm_python: str) -> list[str]:
    """The overrides of an ``asyncgrpo train`` run that starts vLLM's CPU build itself (``server=vllm_launch``)."""
    return [
        "server=vllm_launch",
        f"server.vllm_launch.python={vllm_python}",
        "server.vllm_launch.enforce_eager=true",
        *[f"+server.vllm_launch.env.{k}={v}" for k, v in VLLM_ENV.items()],
        "server.startup_timeout=420",
        "sampling.seed_per_request=false",  # seeded requests under concurrency kill vLLM CPU's engine
    ]


def vllm_pids(log_path: Path) -> set[int]:
    """The API server's, engine's and worker's process ids, as vLLM prints them in its log."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    return {
        int(p) for p in re.findall(r"\((?:APIServer|EngineCore|VllmWorker|Worker)[^)]*? pid=(\d+)\)", text)
    }


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited process nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


NAME = "tiny"
"""The served model name of the tiny test model."""
PROMPT = [17, 250, 31, 999, 4, 86, 512, 77]
MAX_MODEL_LEN = 4096
"""--max-model-len of the default test server (the ``backend`` fixture)."""


@contextmanager
def launched(vllm_python: str, model_dir: Path, run_dir: Path, **settings: Any) -> Iterator[Any]:
    """A vLLM CPU server started by ``server=vllm_launch``'s backend on the tiny model; always stopped.

    ``settings``: ``weight_sync`` goes to ServerConfig, everything else to VllmLaunchConfig (``max_model_len``...).
    """
    from asyncgrpo_cli.config.schema import ServerConfig, VllmLaunchConfig
    from asyncgrpo_cli.server.vllm_launch import VllmLaunchBackend

    server_keys = {k: settings.pop(k) for k in ("weight_sync",) if k in settings}
    launch = VllmLaunchConfig(python=vllm_python, enforce_eager=True, env=dict(VLLM_ENV), **settings)
    cfg = ServerConfig(
        backend="vllm_launch", timeout=120.0, startup_timeout=420.0, vllm_launch=launch, **server_keys
    )
    be = VllmLaunchBackend(cfg, str(model_dir), NAME, run_dir)
    be.start()
    try:
        yield be
    finally:
        be.stop()


REPO = Path(__file__).resolve().parents[2]


def train_on_vllm(
    run: Path, vllm_python: str, *overrides: str, steps: int = 2, max_sync_gap: float = 1e-3
) -> list[dict]:
    """``asyncgrpo train ... server=vllm_launch`` for ``steps`` steps in a subprocess; checks rc 0, that every
    weight sync took (``sync/logprob_gap`` below ``max_sync_gap``: float32 on both sides by default), that trained
    tokens reached every step and that no vLLM process outlives the run; returns the metrics.jsonl rows."""
    args = [
        sys.executable,
        "-m",
        "asyncgrpo_cli",
        "train",
        *overrides,
        *vllm_launch_overrides(vllm_python),
        f"trainer.max_steps={steps}",
        "trainer.save_steps=0",
        "logging.console=plain",
        f"hydra.run.dir={run}",
    ]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    log = run / "vllm_server.log"
    assert out.returncode == 0, out.stderr[-4000:] + (log.read_text()[-3000:] if log.is_file() else "")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and rows[-1]["model_version"] == steps
    gaps = [r["sync/logprob_gap"] for r in rows if "sync/logprob_gap" in r]
    assert len(gaps) == steps and max(gaps) < max_sync_gap, gaps  # every sync took
    pids = vllm_pids(log)
    assert len(pids) >= 2 and not [p for p in pids if running(p)], "vLLM processes outlived the run"
    for r in rows:
        assert r["batch/trained_tokens_per_step"] > 0
    return rows
