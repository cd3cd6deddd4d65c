"""``/v1/completions`` parsing and response building of the embedded server (vLLM shapes and messages)."""

from __future__ import annotations

import pytest

from asyncgrpo_cli.embedded.api import ApiError, ModelContext
from asyncgrpo_cli.embedded.completions import (
    build_completion_response,
    parse_completion_request,
)
from asyncgrpo_cli.embedded.requests import Completion


@pytest.fixture(scope="module")
def ctx(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return ModelContext(served_name="tiny", tokenizer=tok, vocab_size=len(tok), max_model_len=64)


def _error(body: dict, ctx: ModelContext) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_completion_request(body, ctx)
    return e.value


def test_prompt_forms_and_defaults(ctx):
    plan = parse_completion_request({"prompt": [5, 6, 7]}, ctx)
    (req,) = plan.requests
    assert (req.prompt_ids, req.max_tokens, req.n, req.seed) == ([5, 6, 7], 16, 1, None)
    assert (req.params.temperature, req.params.top_k, plan.logprobs, plan.skip_special_tokens) == (
        1.0,
        0,
        None,
        True,
    )
    plan = parse_completion_request({"prompt": [[5], [6, 7]], "n": 2, "seed": -1, "top_k": -1}, ctx)
    assert [r.prompt_ids for r in plan.requests] == [[5], [6, 7]]
    assert plan.requests[0].seed is None and plan.requests[0].params.top_k == 0
    text = parse_completion_request({"prompt": "one two", "max_tokens": None}, ctx).requests[0]
    assert text.prompt_ids == ctx.tokenizer("one two")["input_ids"] and text.max_tokens == 16


def test_vllm_sampling_normalization(ctx):
    low = parse_completion_request({"prompt": [5], "temperature": 0.001}, ctx).requests[0].params
    assert low.temperature == 0.01  # vLLM raises (0, 0.01) to 0.01
    assert parse_completion_request({"prompt": [5], "temperature": 0}, ctx).requests[0].params.greedy


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"prompt": [5], "model": "other"}, 404, "The model `other` does not exist."),
        ({"prompt": []}, 400, "prompt must be"),
        ({"prompt": [[]]}, 400, "cannot be empty"),
        ({"prompt": [5, 99999]}, 400, "Token id 99999 is out of vocabulary"),
        ({"prompt": [5], "top_p": 0}, 400, "top_p must be in (0, 1], got 0"),
        ({"prompt": [5], "top_k": -2}, 400, "top_k must be 0 (disable), or at least 1, got -2."),
        ({"prompt": [5], "min_p": 1.5}, 400, "min_p must be in [0, 1], got 1.5."),
        ({"prompt": [5], "temperature": -1}, 400, "temperature must be non-negative"),
        ({"prompt": [5], "repetition_penalty": 0}, 400, "repetition_penalty must be greater than zero"),
        ({"prompt": [5], "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0."),
        ({"prompt": [5], "n": 0}, 400, "n must be at least 1"),
        ({"prompt": [5], "logprobs": -1}, 400, "Requested sample logprobs of 1024"),
        ({"prompt": [5], "stop_token_ids": ["a"]}, 400, "stop_token_ids must contain only integers"),
        ({"prompt": [5], "stream": True}, 400, "stream=True is not supported by the embedded server"),
        ({"prompt": [5], "stop": ["\n"]}, 400, "stop=['\\n'] is not supported"),
        ({"prompt": [5], "temperature": "hot"}, 400, "temperature must be a number"),
        ({"prompt": [5] * 64}, 400, "However, your request has 64 input tokens"),
        ({"prompt": [5] * 60, "max_tokens": 5}, 400, "(5 > 64 - 60)"),
    ],
)
def test_rejections_name_the_problem(ctx, body, status, fragment):
    err = _error(body, ctx)
    assert err.status == status and fragment in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_response_shape_top_logprobs_and_clamping(ctx):
    plan = parse_completion_request(
        {"prompt": [5, 6], "logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}, ctx
    )
    c = Completion(
        token_ids=[10, 11],
        logprobs=[-1.0, float("-inf")],
        top=[[(12, -0.5), (10, -1.0)], [(13, -0.1), (14, -20000.0)]],
        finish_reason="length",
    )
    data = build_completion_response(plan, [[c]], ctx)
    choice = data["choices"][0]
    assert (choice["token_ids"], choice["prompt_token_ids"], choice["finish_reason"]) == (
        [10, 11],
        [5, 6],
        "length",
    )
    lp = choice["logprobs"]
    assert lp["tokens"] == ["token_id:10", "token_id:11"]
    assert lp["token_logprobs"] == [-1.0, -9999.0]
    # sampled token first; at most N + 1 entries; N when the sampled token is in the top N
    assert list(lp["top_logprobs"][0].items()) == [("token_id:10", -1.0), ("token_id:12", -0.5)]
    assert list(lp["top_logprobs"][1].items()) == [
        ("token_id:11", -9999.0),
        ("token_id:13", -0.1),
        ("token_id:14", -9999.0),
    ]
    assert lp["text_offset"] == [0, len("token_id:10")]
    assert data["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
        "prompt_tokens_details": None,
    }
    assert data["object"] == "text_completion" and data["model"] == "tiny"


def test_stop_token_is_left_out_of_the_text(ctx):
    plan = parse_completion_request({"prompt": [5]}, ctx)
    hello = ctx.tokenizer("hello")["input_ids"]
    eos = ctx.tokenizer.convert_tokens_to_ids("<|im_end|>")
    stopped = Completion(token_ids=hello + [eos], logprobs=[0.0] * (len(hello) + 1), finish_reason="stop")
    choice = build_completion_response(plan, [[stopped]], ctx)["choices"][0]
    assert choice["text"] == "hello" and choice["logprobs"] is None and choice["token_ids"] is None
