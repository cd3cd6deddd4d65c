"""End to end with a LoRA adapter, the way users run it: ``asyncgrpo train +recipe=tiny model.lora.enabled=true
server.weight_sync=lora ...`` in a subprocess, on the embedded server."""

from __future__ import annotations

import re

import pytest
import torch

from tests.test_e2e import read_metrics, train

pytestmark = pytest.mark.slow


def test_lora_sync_serves_each_version_under_its_own_name(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    out = train(
        "model.lora.enabled=true",
        "model.lora.r=8",
        "server.weight_sync=lora",
        "rollout.max_staleness=0",
        "trainer.max_steps=3",
        "trainer.save_steps=0",
        f"hydra.run.dir={run}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["model_version"] == 3
    gaps = [r["sync/logprob_gap"] for r in rows]
    assert max(gaps) < 1e-3, gaps  # every version served under its adapter name equals the trainer's policy
    assert all(r["sync/adapter_versions_loaded"] == 2 for r in rows)  # max_staleness + 2 kept
    assert all(r["perf/weight_sync_pause_s"] == 0 for r in rows)

    log = (run / "embedded_server.log").read_text()
    loaded = re.findall(r"(?<!un)loaded LoRA adapter '(policy-v\d)'", log)
    unloaded = dict(re.findall(r"unloaded LoRA adapter '(policy-v\d)' \(served (\d+) requests\)", log))
    assert loaded == ["policy-v0", "policy-v1", "policy-v2", "policy-v3"]
    assert sorted(unloaded) == ["policy-v0", "policy-v1"]
    assert int(unloaded["policy-v0"]) >= 4  # the first groups' rollouts (G=4) asked for policy-v0 by name
    assert not list((run / "adapters").iterdir())  # serving copies removed at the end

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = run / "checkpoints" / "step-000003"
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32).eval()
    assert not [k for k in merged.state_dict() if "lora" in k or "base_layer" in k]

    def base():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    adapted = PeftModel.from_pretrained(base(), str(ckpt / "adapter")).eval()  # (PEFT injects into its base)
    ids = torch.tensor([[17, 250, 31, 999, 4, 86]])
    with torch.no_grad():  # the checkpoint's adapter and its merged model are the same trained policy
        assert torch.allclose(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)
        assert not torch.allclose(adapted(input_ids=ids).logits, base()(input_ids=ids).logits, atol=1e-4)
