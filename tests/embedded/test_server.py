"""The embedded server over real HTTP: a subprocess started by EmbeddedServerProcess on the tiny model (port 0).

Checks the vLLM contract the rollout client and the weight sync rely on: token-id completions whose sampler
log-probs match a transformers forward, top-N log-probs, seeds, concurrency, length errors, /metrics names,
pause (keep / abort) and resume, reload_weights from safetensors (tied embeddings), and a busy port.
"""

from __future__ import annotations

import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.server.launch import EmbeddedServerProcess

pytestmark = pytest.mark.slow

NAME = "tiny"
MAX_MODEL_LEN = 400
PROMPT = [17, 250, 31, 999, 4, 86, 512, 77]
SERVER = {"max_model_len": MAX_MODEL_LEN}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Reference forwards on one thread (see the conftest fixture)."""


def complete(client: httpx.Client, **body) -> dict:
    payload = {
        "model": NAME,
        "prompt": PROMPT,
        "max_tokens": 12,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        **body,
    }
    resp = client.post("/v1/completions", json=payload)
    assert resp.status_code == 200, resp.text
    return resp.json()


def token_id(key: str) -> int:
    return int(key.split(":")[1])


@torch.no_grad()
def tempered_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at the positions that predicted each output token, [len(output), V]."""
    ids = torch.tensor([prompt + output])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def metric_values(client: httpx.Client) -> dict[str, float]:
    """``name{labels}`` -> value for every sample line of /metrics."""
    text = client.get("/metrics").text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([-+0-9.eEinfa]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def test_health_and_models(client):
    health = client.get("/health")
    assert health.status_code == 200 and health.content == b""
    card = client.get("/v1/models").json()["data"][0]
    assert (card["id"], card["object"], card["max_model_len"]) == (NAME, "model", MAX_MODEL_LEN)
    assert client.get("/get_world_size").json() == {"world_size": 1}
    info = client.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["parallel_config"]["data_parallel_size"] == 1 and info["lora_config"] is None
    missing = client.get("/no/such/route")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_sampler_logprobs_match_a_transformers_forward(client, reference):
    data = complete(client, temperature=0.7, logprobs=5, seed=3)
    choice = data["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT and choice["finish_reason"] in ("length", "stop")
    out = choice["token_ids"]
    lp = choice["logprobs"]
    assert [token_id(t) for t in lp["tokens"]] == out
    ref = tempered_logprobs(reference, PROMPT, out, 0.7)
    expected = ref.gather(1, torch.tensor(out)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"]), expected, atol=1e-5, rtol=0)
    for pos, entry in enumerate(lp["top_logprobs"]):
        assert 5 <= len(entry) <= 6  # the sampled token plus the top 5
        keys = list(entry)
        assert token_id(keys[0]) == out[pos] and entry[keys[0]] == lp["token_logprobs"][pos]
        top = [entry[k] for k in keys[1:]]
        assert top == sorted(top, reverse=True)
        best = ref[pos].topk(5)
        assert {token_id(k) for k in keys} >= set(best.indices.tolist())
        for k in keys:
            assert entry[k] == pytest.approx(ref[pos, token_id(k)].item(), abs=1e-5)
    assert data["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(out),
        "total_tokens": len(PROMPT) + len(out),
        "prompt_tokens_details": None,
    }


def test_filtered_candidates_are_clamped_to_minus_9999(client):
    data = complete(client, temperature=1.0, top_k=2, logprobs=4, seed=1, max_tokens=3)
    lp = data["choices"][0]["logprobs"]
    for entry in lp["top_logprobs"]:
        values = sorted(entry.values(), reverse=True)
        assert values[2:] == [-9999.0] * (len(values) - 2)  # outside the top-2 support
        assert sum(math.exp(v) for v in values[:2]) == pytest.approx(1.0, abs=1e-5)


def test_seed_determinism(client):
    a = complete(client, temperature=1.0, seed=123, max_tokens=16)["choices"][0]["token_ids"]
    b = complete(client, temperature=1.0, seed=123, max_tokens=16)["choices"][0]["token_ids"]
    c = complete(client, temperature=1.0, seed=124, max_tokens=16)["choices"][0]["token_ids"]
    assert a == b and a != c


def test_n_and_batched_prompts(client):
    data = complete(client, prompt=[PROMPT, PROMPT[:4]], n=2, temperature=1.0, max_tokens=5)
    choices = data["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in choices] == [PROMPT, PROMPT, PROMPT[:4], PROMPT[:4]]
    text = complete(client, prompt="one two three", max_tokens=3, return_token_ids=False)["choices"][0]
    assert isinstance(text["text"], str) and text["token_ids"] is None


def test_concurrent_requests_all_finish(client):
    before = metric_values(client)
    key = f'vllm:generation_tokens_total{{engine="0",model_name="{NAME}"}}'

    def one(i: int) -> dict:
        return complete(
            client, prompt=PROMPT[: 2 + i % 6], max_tokens=20, temperature=1.0, seed=i, ignore_eos=True
        )

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert all(r["choices"][0]["finish_reason"] == "length" for r in results)
    assert all(len(r["choices"][0]["token_ids"]) == 20 for r in results)
    assert metric_values(client)[key] - before[key] == 16 * 20


def test_length_errors_follow_vllm(client):
    resp = client.post("/v1/completions", json={"prompt": [5] * 390, "max_tokens": 20})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert err["message"].startswith(
        "'max_tokens' or 'max_completion_tokens' is too large: 20. This model's "
        "maximum context length is 400 tokens and your request has 390 input tokens "
        "(20 > 400 - 390)"
    )
    resp = client.post("/v1/completions", json={"prompt": [5] * 400, "max_tokens": 1})
    assert (
        resp.status_code == 400
        and "However, your request has 400 input tokens" in resp.json()["error"]["message"]
    )
    resp = client.post("/v1/completions", json={"prompt": [5], "logprobs": 21})
    assert (
        resp.json()["error"]["message"]
        == "Requested sample logprobs of 21, which is greater than max allowed: 20"
    )


def test_metrics_use_vllm_names(client):
    complete(client, max_tokens=2, ignore_eos=True)
    m = metric_values(client)
    labels = f'{{engine="0",model_name="{NAME}"}}'
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
    ):
        assert f"vllm:{name}{labels}" in m, name
    assert m[f"vllm:prompt_tokens_total{labels}"] > 0
    assert any(k.startswith("vllm:request_success_total{") and 'finished_reason="length"' in k for k in m)
    info = [k for k in m if k.startswith("vllm:cache_config_info")]
    assert len(info) == 1 and 'kv_cache_size_tokens="65536"' in info[0] and 'block_size="' in info[0]
    assert 'num_gpu_blocks="' in info[0]


def _start_long(client: httpx.Client, n: int, pool: ThreadPoolExecutor) -> list:
    futures = [
        pool.submit(
            complete,
            client,
            prompt=PROMPT,
            max_tokens=MAX_MODEL_LEN - len(PROMPT),
            ignore_eos=True,
            temperature=1.0,
            seed=i,
            logprobs=0,
        )
        for i in range(n)
    ]
    running = f'vllm:num_requests_running{{engine="0",model_name="{NAME}"}}'
    deadline = time.monotonic() + 30
    while metric_values(client)[running] < n:
        assert time.monotonic() < deadline, "requests never started"
        time.sleep(0.02)
    return futures


def test_pause_keep_freezes_in_flight_requests_until_resume(client):
    generated = f'vllm:generation_tokens_total{{engine="0",model_name="{NAME}"}}'
    with ThreadPoolExecutor(4) as pool:
        futures = _start_long(client, 3, pool)
        try:
            assert client.post("/pause", params={"mode": "keep", "clear_cache": "false"}).json() == {
                "status": "paused"
            }
            assert client.get("/is_paused").json() == {"is_paused": True}
            frozen = metric_values(client)[generated]
            # arrives while paused: queued, not rejected (ignore_eos: its "length" is what the test reads)
            queued = pool.submit(complete, client, max_tokens=3, ignore_eos=True)
            time.sleep(0.5)
            assert metric_values(client)[generated] == frozen
            assert not any(f.done() for f in futures) and not queued.done()
        finally:
            assert client.post("/resume").json() == {"status": "resumed"}
        results = [f.result(timeout=60) for f in futures]
        assert queued.result(timeout=60)["choices"][0]["finish_reason"] == "length"
    for r in results:
        assert r["choices"][0]["finish_reason"] == "length"
        assert len(r["choices"][0]["token_ids"]) == MAX_MODEL_LEN - len(PROMPT)
    assert client.get("/is_paused").json() == {"is_paused": False}


def test_pause_abort_finishes_in_flight_requests_with_partial_output(client):
    with ThreadPoolExecutor(2) as pool:
        futures = _start_long(client, 2, pool)
        try:
            assert client.post("/pause", params={"mode": "abort"}).json() == {"status": "paused"}
            results = [f.result(timeout=30) for f in futures]
        finally:
            client.post("/resume")
    for r in results:
        choice = r["choices"][0]
        assert choice["finish_reason"] == "abort"
        assert len(choice["token_ids"]) < MAX_MODEL_LEN - len(PROMPT)
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert complete(client, max_tokens=2)["choices"][0]["finish_reason"] in ("length", "stop")


def test_reload_weights_changes_logprobs_and_clears_the_prefix_cache(
    client, reference, tiny_model_dir, tmp_path
):
    greedy = {"temperature": 0.0, "logprobs": 1, "max_tokens": 6}
    before = complete(client, **greedy)["choices"][0]  # also fills the prefix cache with PROMPT
    from transformers import AutoModelForCausalLM

    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        new.model.embed_tokens.weight.mul_(3.0).add_(0.01)  # tied: moves lm_head too
        new.model.norm.weight.mul_(1.5)
    new.save_pretrained(tmp_path)
    try:
        resp = client.post(
            "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
        )
        assert resp.status_code == 200 and resp.json() == {"results": [None]}
        after = complete(client, **greedy)["choices"][0]
        lp = torch.tensor(after["logprobs"]["token_logprobs"])
        ref = tempered_logprobs(new, PROMPT, after["token_ids"], 1.0)
        expected = ref.gather(1, torch.tensor(after["token_ids"])[:, None]).squeeze(1)
        torch.testing.assert_close(
            lp, expected, atol=1e-5, rtol=0
        )  # the first token too: no stale prompt cache
        assert after["logprobs"]["token_logprobs"][0] != pytest.approx(
            before["logprobs"]["token_logprobs"][0]
        )
    finally:
        client.post(
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(tiny_model_dir)}},
        )
    restored = complete(client, **greedy)["choices"][0]
    assert restored["token_ids"] == before["token_ids"]
    bad = client.post("/collective_rpc", json={"method": "init_weight_transfer_engine", "kwargs": {}})
    assert bad.status_code == 400 and "init_weight_transfer_engine" in bad.json()["error"]["message"]
    version = client.post("/update_weight_version", json={"new_version": "v1"}).json()
    assert version == {"success": True, "new_version": "v1"}
    assert client.get("/weight_info").json() == {"weight_version": "v1"}
    assert client.post("/reset_prefix_cache").json() == {"success": True}


def test_busy_port_is_a_clear_error(server, tiny_model_dir, tmp_path):
    cfg = EmbeddedServerConfig(port=server.port)
    second = EmbeddedServerProcess(tiny_model_dir, cfg, log_path=tmp_path / "second.log", startup_timeout=60)
    with pytest.raises(UserError, match=r"server\.embedded\.port.*in use.*or 0"):
        second.start()
    assert second.proc is None
    second.stop()  # idempotent


def test_stop_is_idempotent_and_by_pid(tiny_model_dir, tmp_path):
    proc = EmbeddedServerProcess(
        tiny_model_dir, EmbeddedServerConfig(), log_path=tmp_path / "s.log", startup_timeout=60
    )
    with proc:
        child = proc.proc
        assert httpx.get(proc.base_url + "/health", timeout=10).status_code == 200
    assert child.poll() is not None
    proc.stop()
