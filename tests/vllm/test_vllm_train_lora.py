"""End to end against real vLLM with a LoRA adapter: ``asyncgrpo train +recipe=tiny server=vllm_launch
model.lora.enabled=true server.weight_sync=lora ...`` in a subprocess. ``train`` starts vLLM's CPU build with the
LoRA flags, loads each version as ``policy-vN`` (the rollout process asks for it by name), checks every sync under
that name, and unloads what leaves the ``max_staleness + 2`` window."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.vllm.common import VLLM_ENV, running, vllm_pids

pytestmark = pytest.mark.vllm


def test_train_with_lora_adapter_sync_on_vllm(tmp_path, vllm_python):
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "asyncgrpo_cli",
        "train",
        "+recipe=tiny",
        "server=vllm_launch",
        f"server.vllm_launch.python={vllm_python}",
        "server.vllm_launch.max_model_len=256",
        "server.vllm_launch.enforce_eager=true",
        *[f"+server.vllm_launch.env.{k}={v}" for k, v in VLLM_ENV.items()],
        "server.startup_timeout=420",
        "sampling.seed_per_request=false",
        "model.lora.enabled=true",
        "model.lora.r=8",
        "server.weight_sync=lora",
        "rollout.max_staleness=0",
        "trainer.max_steps=3",
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
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["model_version"] == 3
    gaps = [r["sync/logprob_gap"] for r in rows]
    assert max(gaps) < 1e-3, gaps  # every version took, scored under its adapter name
    text = log.read_text(errors="replace")
    for arg in ("'enable_lora': True", "'max_lora_rank': 8", "'max_loras': 2"):  # max_staleness + 2
        assert arg in text
    loaded = re.findall(r"Loaded new LoRA adapter: name '(policy-v\d)'", text)
    removed = re.findall(r"Removed LoRA adapter: name '(policy-v\d)'", text)
    assert loaded == ["policy-v0", "policy-v1", "policy-v2", "policy-v3"] and removed == [
        "policy-v0",
        "policy-v1",
    ]
    # vLLM 0.32 warns once, on the first request that carries a LoRA adapter. It comes before policy-v1 is loaded,
    # i.e. before any weight-sync check: a rollout asked for policy-v0 by name.
    first_lora_request = text.index("different tokenizers for different LoRAs")
    assert first_lora_request < text.index("Loaded new LoRA adapter: name 'policy-v1'")
    pids = vllm_pids(log)
    assert len(pids) >= 2 and not [p for p in pids if running(p)], "vLLM processes outlived the run"
