"""Sampling masks against real servers: the embedded server's ``/inference/v1/generate`` (a subprocess on the tiny
model) checked against a transformers forward, the rollout client on it, the probe on it and on a stdlib server
that answers like vLLM without ``--enable-scale-out`` / ``--return-sampling-mask``, and two ``asyncgrpo train``
runs with top-k sampling: with masks the trainer's log-probs match the sampler's, with ``sampling_mask=off`` they
are biased by the surviving mass (and a warning says so).
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch

from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.embedded.sampling import BatchParams, processed_logprobs
from asyncgrpo_cli.embedded.sampling import SamplingParams as FilterParams
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.rollout.client import CompletionClient, SamplingParams
from asyncgrpo_cli.samples import CandidateSets
from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.server.mask_support import resolve_sampling_mask
from asyncgrpo_cli.server.probe import probe_server
from asyncgrpo_cli.server.report import read_server
from tests.test_e2e import read_metrics, train

NAME = "tiny"
PROMPT = [17, 250, 31, 999, 4, 86, 512, 77]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Reference forwards on one thread (see the conftest fixture)."""


def generate(server, **sampling) -> dict:
    body = {"model": NAME, "token_ids": PROMPT, "sampling_params": {"max_tokens": 10, "seed": 5, **sampling}}
    resp = httpx.post(f"{server.base_url}/inference/v1/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow
@pytest.mark.parametrize(
    "filters", [dict(top_k=6), dict(top_k=40, top_p=0.5, temperature=0.8), dict(min_p=0.5, temperature=0.7)]
)
def test_masks_are_the_filtered_support_and_normalize_the_logprobs(server, reference, filters):
    """Each mask equals the support of the filters applied to a transformers forward's logits, holds the sampled
    token, and the returned log-prob is the log-softmax over exactly that set."""
    data = generate(server, logprobs=2, **filters)
    (choice,) = data["choices"]
    out, masks, content = choice["token_ids"], choice["sampling_mask"], choice["logprobs"]["content"]
    assert len(masks) == len(out) == len(content) > 0
    temperature = filters.get("temperature", 1.0)
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1 : -1].float()
    params = BatchParams.build([FilterParams(**filters)] * len(out), logits.shape[1])
    support = processed_logprobs(logits, params).isfinite()
    for i, (tok, mask, entry) in enumerate(zip(out, masks, content)):
        assert mask == sorted(mask) and tok in mask and entry["token_id"] == tok
        assert mask == torch.nonzero(support[i]).squeeze(1).tolist()
        renormalized = torch.log_softmax(logits[i, mask] / temperature, dim=0)[mask.index(tok)]
        assert entry["logprob"] == pytest.approx(float(renormalized), abs=2e-4)
        assert entry["top_logprobs"][0]["token_id"] == tok  # sampled first
    if filters == dict(top_k=6):
        assert all(len(m) == 6 for m in masks)


@pytest.mark.slow
def test_untruncated_and_greedy_requests_have_no_mask(server):
    assert generate(server)["choices"][0]["sampling_mask"] is None
    assert generate(server, temperature=0, top_k=5)["choices"][0]["sampling_mask"] is None


@pytest.mark.slow
def test_client_keeps_compact_capped_sets(server):
    async def run(cap: int):
        client = CompletionClient(server.base_url, NAME, timeout=60, max_retries=0, max_connections=2)
        try:
            params = SamplingParams(max_tokens=6, top_k=5, num_logprobs=3)
            return await client.generate(PROMPT, params, seed=11, max_mask_candidates=cap)
        finally:
            await client.close()

    turn = asyncio.run(run(cap=16))
    sets = turn.output_sampling_mask
    assert isinstance(sets, CandidateSets) and len(sets) == len(turn.output_ids) == 6
    assert sets.sizes.tolist() == [5] * 6 and sets.num_overflow == sets.num_invalid == 0
    assert all(t in sets[i] for i, t in enumerate(turn.output_ids))
    assert all(len(top) >= 3 for top in turn.output_sampler_logprobs)
    capped = asyncio.run(run(cap=4)).output_sampling_mask
    assert capped.num_with_set == 0 and capped.num_overflow == 6


@pytest.mark.slow
def test_probe_finds_mask_support_on_the_embedded_server(server):
    control = ServerControl(server.base_url, timeout=60)
    try:
        report = read_server(control)
    finally:
        control.close()
    assert report.embedded and report.generate_route == "enabled" and report.return_sampling_mask is True
    cfg = compose_config(["+recipe=tiny", "sampling.top_k=8", "sampling.sampling_mask=required"])
    assert report.returns_sampling_mask and resolve_sampling_mask(report, cfg)


class _NoScaleOutVllm(BaseHTTPRequestHandler):
    """Answers the probe like vLLM started without --enable-scale-out and --return-sampling-mask."""

    def log_message(self, format, *args):  # noqa: A002
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        pages = {
            "/v1/models": {"data": [{"id": "m", "max_model_len": 4096}]},
            "/is_paused": {"is_paused": False},
            "/version": {"version": "0.33.0"},
            "/server_info": {
                "vllm_config": {
                    "model_config": {"model": "/m", "logprobs_mode": "processed_logprobs", "max_logprobs": 20,
                                     "dtype": "float32", "return_sampling_mask": False},
                    "device_config": {"device": "cuda"},
                    "weight_transfer_config": {"backend": "nccl"},
                }
            },
        }  # fmt: skip
        path = self.path.split("?")[0]
        self._send(200, pages[path]) if path in pages else self._send(404, {"detail": "Not Found"})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/inference/v1/generate":
            message = (
                "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
            )
            self._send(403, {"error": {"message": message, "type": "PermissionDeniedError", "code": 403}})
        else:
            self._send(404, {"detail": "Not Found"})


def test_probe_of_a_vllm_without_the_flags_names_them():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _NoScaleOutVllm)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    control = ServerControl(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=5)
    try:
        report = read_server(control)
        assert (report.generate_route, report.return_sampling_mask) == ("disabled", False)
        cfg = compose_config(
            ["+recipe=tiny", "server=vllm", "sampling.top_k=64", "sampling.sampling_mask=required",
             "sampling.seed_per_request=false"]
        )  # fmt: skip
        with pytest.raises(UserError) as err:
            probe_server(control, cfg, model_path="/m")
        msg = str(err.value)
        assert (
            "answers 403: the server was started without --enable-scale-out (fix: --enable-scale-out)" in msg
        )
        assert "(fix: --return-sampling-mask)" in msg and "server.verify_sync=false" not in msg
        restart = msg.split("Restart vLLM with (every fix applied):")[1]
        assert "--return-sampling-mask --enable-scale-out" in restart
    finally:
        control.close()
        httpd.shutdown()
        httpd.server_close()


# ---------------------------------------------------------------- end to end
@pytest.mark.slow
def test_train_with_top_k_renormalizes_over_the_sampling_masks(tmp_path):
    """Step 1 trains on samples of the weights the trainer holds: with masks its log-probs equal the sampler's;
    without them they are lower by log(surviving mass), about log(1024 / 8) on the near-uniform tiny model."""
    runs = {}
    for mode in ("auto", "off"):
        run = tmp_path / mode
        out = train(
            "sampling.top_k=8",
            f"sampling.sampling_mask={mode}",
            "trainer.max_steps=2",
            "trainer.save_steps=0",
            "trainer.save_final=false",
            f"hydra.run.dir={run}",
            timeout=400,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        logs = out.stdout + out.stderr + "".join(p.read_text() for p in run.glob("*.log"))
        runs[mode] = (read_metrics(run), logs)
    (first, second), logs = runs["auto"]
    assert first["rollout/sampling_mask_frac"] == 1.0 and first["sampling/sampling_mask_frac"] == 1.0
    assert first["rollout/sampling_mask_size_mean"] == pytest.approx(8.0, abs=0.5)
    assert first["rollout/sampling_mask_overflow_frac"] == 0.0
    assert first["sampling/sampling_logp_difference/mean"] < 1e-3
    assert first["sampling/masked_mean"] == 0.0
    assert "biased" not in logs
    (first_off, _), logs_off = runs["off"]
    assert "sampling/sampling_mask_frac" not in first_off and "rollout/sampling_mask_frac" not in first_off
    assert first_off["sampling/sampling_logp_difference/mean"] > 2.0
    assert "sampling.sampling_mask=off" in logs_off and "biased" in logs_off
