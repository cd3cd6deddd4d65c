"""End to end against real vLLM: ``asyncgrpo train +recipe=tiny server=vllm_launch ...`` in a subprocess, the way
users run it. ``train`` starts vLLM's CPU build with the required flags, syncs weights through the worker
extension after every step (each sync checked by ``server.verify_sync``), and stops vLLM's processes on exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.vllm.common import running, vllm_launch_overrides, vllm_pids

pytestmark = pytest.mark.vllm


def test_train_two_steps_with_vllm_launch(tmp_path, vllm_python):
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "asyncgrpo_cli",
        "train",
        "+recipe=tiny",
        *vllm_launch_overrides(vllm_python),
        "server.vllm_launch.max_model_len=256",
        "trainer.max_steps=2",
        "trainer.save_steps=0",
        "logging.console=plain",
        f"hydra.run.dir={run}",
    ]
    out = subprocess.run(
        args, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    log = run / "vllm_server.log"
    assert out.returncode == 0, out.stderr[-4000:] + (log.read_text()[-3000:] if log.is_file() else "")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["model_version"] == 2
    gaps = [r["sync/logprob_gap"] for r in rows if "sync/logprob_gap" in r]
    assert len(gaps) == 2 and max(gaps) < 1e-3, gaps  # every sync took
    assert all(r["perf/weight_sync_s"] > 0 for r in rows)
    text = log.read_text(errors="replace")
    assert "asyncgrpo_reload_weights" in text  # the worker extension was injected and used
    pids = vllm_pids(log)
    assert len(pids) >= 2, text[-2000:]
    assert not [p for p in pids if running(p)], "vLLM processes outlived the run"
