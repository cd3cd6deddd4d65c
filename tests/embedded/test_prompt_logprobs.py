"""``prompt_logprobs`` on the embedded server: the scored prefill against a plain transformers forward, the engine
(temperature-independent, prefix cache bypassed), the response shape and vLLM's validation messages."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo_cli.embedded.api import ApiError, ModelContext
from asyncgrpo_cli.embedded.completions import build_completion_response, parse_completion_request
from asyncgrpo_cli.embedded.engine import GenerationEngine
from asyncgrpo_cli.embedded.generate import build_generate_response, parse_generate_request
from asyncgrpo_cli.embedded.model import load_model
from asyncgrpo_cli.embedded.prompt_logprobs import scored_prefill

PROMPT = [17, 250, 31, 999, 4, 86, 512, 77, 3, 120]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Reference forwards on one thread (see the conftest fixture)."""


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def ctx(tiny_model_dir, model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return ModelContext(served_name="tiny", tokenizer=tok, vocab_size=vocab, max_model_len=64)


@pytest.fixture(scope="module")
def reference(model):
    """Full-vocabulary log-softmax of one transformers forward over the prompt (T=1, no processing)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0].float()
    return logits.log_softmax(-1)


def _engine(model) -> GenerationEngine:
    return GenerationEngine(model, eos_token_ids=[], max_model_len=64, kv_cache_tokens=256)


def _run(engine: GenerationEngine, request):
    handle = engine.submit(request)
    for _ in range(50):
        if handle.done:
            return handle
        engine.step()
    raise AssertionError("request did not finish")


@torch.inference_mode()
@pytest.mark.parametrize("chunk", [None, 3])
def test_scored_prefill_matches_a_transformers_forward(model, reference, chunk):
    row, last, s = scored_prefill(model, PROMPT, 5, chunk=chunk)
    n = len(PROMPT)
    assert row.length == n and s.token_logprobs.shape == (n - 1,) and s.top_ids.shape == (n - 1, 5)
    assert torch.allclose(last.log_softmax(-1), reference[-1], atol=1e-5)
    targets = torch.tensor(PROMPT[1:])
    ref_tok = reference[:-1].gather(-1, targets[:, None])[:, 0]
    assert torch.allclose(s.token_logprobs, ref_tok, atol=1e-5)
    assert s.ranks.tolist() == (reference[:-1] >= ref_tok[:, None]).sum(-1).tolist()
    ref_top, ref_ids = reference[:-1].topk(5, dim=-1)
    assert torch.allclose(s.top_logprobs, ref_top, atol=1e-5)
    assert s.top_ids.tolist() == ref_ids.tolist()


def test_completions_prompt_logprobs_shape_and_values(model, ctx, reference):
    body = {
        "prompt": PROMPT,
        "max_tokens": 1,
        "prompt_logprobs": 3,
        "temperature": 0.3,  # prompt scores ignore the sampling knobs
        "top_k": 2,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    plan = parse_completion_request(body, ctx)
    engine = _engine(model)
    handle = _run(engine, plan.requests[0])
    choice = build_completion_response(plan, [handle.completions], ctx)["choices"][0]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    for i, entry in enumerate(plp[1:]):
        actual = PROMPT[i + 1]
        keys = list(entry)
        assert keys[0] == str(actual)  # the actual token first, keys are plain ids (not "token_id:N")
        assert 3 <= len(keys) <= 4
        assert set(entry[keys[0]]) == {"logprob", "rank", "decoded_token"}
        assert entry[str(actual)]["logprob"] == pytest.approx(reference[i, actual].item(), abs=1e-5)
        rank = int((reference[i] >= reference[i, actual]).sum())
        assert entry[str(actual)]["rank"] == rank
        text = ctx.tokenizer.decode(
            [actual]
        )  # a byte-fallback fragment is re-decoded (the vLLM test checks it)
        assert entry[str(actual)]["decoded_token"] == text or text.endswith("\ufffd")
        ref_ids = reference[i].topk(3).indices.tolist()
        assert keys == list(dict.fromkeys([str(actual)] + [str(t) for t in ref_ids]))
        assert [entry[str(t)]["rank"] for t in ref_ids] == [1, 2, 3]


def test_prompt_logprobs_bypass_the_prefix_cache(model, ctx):
    engine = _engine(model)
    plain = parse_completion_request({"prompt": PROMPT, "max_tokens": 1}, ctx).requests[0]
    _run(engine, plain)
    assert engine.stats().prefill_tokens_total == len(PROMPT)
    scored = parse_completion_request({"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 0, "n": 2}, ctx)
    handle = _run(engine, scored.requests[0])
    stats = engine.stats()
    assert stats.prefill_tokens_total == 2 * len(PROMPT)  # scored once for its two choices, cache not read
    scores = [c.prompt_scores for c in handle.completions]
    assert scores[0] is not None and scores[0] is scores[1]
    assert scores[0].top_ids.shape == (len(PROMPT) - 1, 0)  # prompt_logprobs=0: the actual token only
    again = _run(engine, plain)  # the scored prefill was written to the cache
    assert (
        engine.stats().prefill_tokens_total == 2 * len(PROMPT) and again.completions[0].prompt_scores is None
    )
    data = build_completion_response(scored, [handle.completions], ctx)
    assert all(len(e) == 1 for c in data["choices"] for e in c["prompt_logprobs"][1:])
    plain_data = build_completion_response(
        parse_completion_request({"prompt": PROMPT, "max_tokens": 1}, ctx), [again.completions], ctx
    )
    assert plain_data["choices"][0]["prompt_logprobs"] is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (21, "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
        (-1, "Requested prompt logprobs of {vocab}, which is greater than max allowed: 20"),
        (-2, "`prompt_logprobs` must be a positive value or -1."),
        ("3", "`prompt_logprobs` must be an integer."),
    ],
)
def test_completions_validation_messages(ctx, value, message):
    with pytest.raises(ApiError) as e:
        parse_completion_request({"prompt": PROMPT, "prompt_logprobs": value}, ctx)
    assert (e.value.status, e.value.message) == (400, message.format(vocab=ctx.vocab_size))


def test_generate_route_returns_prompt_logprobs(model, ctx, reference):
    body = {
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 1, "prompt_logprobs": 2, "temperature": 0.0},
    }
    plan = parse_generate_request(body, ctx)
    handle = _run(_engine(model), plan.request)
    plp = build_generate_response(plan, handle.completions, ctx)["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    assert plp[3][str(PROMPT[3])]["logprob"] == pytest.approx(reference[2, PROMPT[3]].item(), abs=1e-5)
    with pytest.raises(ApiError) as e:
        parse_generate_request({**body, "sampling_params": {"prompt_logprobs": -3}}, ctx)
    assert e.value.message == "prompt_logprobs must be non-negative or -1, got -3."
