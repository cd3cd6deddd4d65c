"""LoRA under FSDP2 on CPU (gloo): two ranks gather the adapter in lockstep for every sync and checkpoint, rank 0
loads each version on the embedded server, and the run resumes on one process from the 2-rank checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.test_distributed import torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_two_ranks_sync_the_adapter_and_resume_on_one(tmp_path):
    run = tmp_path / "run"
    base = [
        "-m",
        "asyncgrpo_cli",
        "train",
        "+recipe=tiny",
        "logging.console=plain",
        "model.lora.enabled=true",
        "model.lora.r=8",
        "server.weight_sync=lora",
        f"hydra.run.dir={run}",
    ]
    out = torchrun(*base, "trainer.max_steps=2", "trainer.save_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert max(r["sync/logprob_gap"] for r in rows) < 1e-3  # the sharded adapter reached the server whole
    ckpt = run / "checkpoints" / "step-000002"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {
        p.name for p in (ckpt / "adapter").iterdir()
    }
    out = subprocess.run(
        [sys.executable, *base, "trainer.max_steps=3", "trainer.resume=auto"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["model_version"] == 3
    assert rows[-1]["sync/logprob_gap"] < 1e-3
