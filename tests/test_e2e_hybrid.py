"""End to end on the tiny Qwen3.5 hybrid: ``asyncgrpo train +recipe=tiny model=tiny_hybrid trainer.max_steps=3``
under tree packing (the default) and sequence packing. The embedded server generates with the hybrid (state per
request), the trainer packs rows with the exact gated-DeltaNet forward, and the weight-sync check passes after
every push: the server's log-probs of a probe equal the trainer's within 1e-3 nats (measured ~1e-7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("packing", ["tree", "sequence"])
def test_train_tiny_hybrid(tmp_path, packing):
    run = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable, "-m", "asyncgrpo_cli", "train", "+recipe=tiny", "model=tiny_hybrid",
            f"packing={packing}", "logging.console=plain", "trainer.max_steps=3", "trainer.save_steps=0",
            f"hydra.run.dir={run}",
        ],
        capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["model_version"] == 3
    assert all(r["sync/logprob_gap"] < 1e-3 for r in rows), [r["sync/logprob_gap"] for r in rows]
    ratios = [r["batch/packing_ratio"] for r in rows]
    assert all(x > 1.0 for x in ratios) if packing == "tree" else all(x == 1.0 for x in ratios), ratios
    logs = out.stderr + out.stdout
    assert "linear attention (gated DeltaNet, qwen3_5) in decoder layers [0, 1, 2]" in logs
