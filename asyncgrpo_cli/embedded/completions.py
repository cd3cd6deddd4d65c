"""``/v1/completions`` request parsing and response building, with vLLM's field names, shapes and messages.

The embedded server supports the subset the rollout client uses (token-id or text prompts, n, the sampling
knobs, seed, logprobs, prompt_logprobs (``prompt_logprobs.py``), return_token_ids, return_tokens_as_token_ids, stop_token_ids, ignore_eos). A field it
does not implement is rejected with HTTP 400 rather than silently ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.embedded.api import ApiError, ModelContext
from asyncgrpo_cli.embedded.prompt_logprobs import parse_prompt_logprobs, prompt_logprobs_entries
from asyncgrpo_cli.embedded.requests import Completion, GenerationRequest
from asyncgrpo_cli.embedded.sampling import SamplingParams

LOGPROB_FLOOR = -9999.0
"""vLLM's completions serializer clamps log-probs (and -inf) to this value."""
MIN_TEMPERATURE = 1e-2
"""vLLM raises temperatures in (0, 0.01) to 0.01 (they overflow); 0 means greedy."""
DEFAULT_MAX_TOKENS = 16

# Fields vLLM accepts that the embedded server does not implement, with the value that means "not used".
_UNSUPPORTED: dict[str, Any] = {
    "stream": False,
    "echo": False,
    "stop": None,
    "min_tokens": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "logprob_token_ids": None,
    "suffix": None,
    "structured_outputs": None,
    "response_format": None,
    "best_of": None,
    "return_weight_versions": False,
    "truncate_prompt_tokens": None,
}


@dataclass
class CompletionPlan:
    requests: list[GenerationRequest]
    logprobs: int | None
    tokens_as_ids: bool
    return_token_ids: bool
    skip_special_tokens: bool


def counts_and_seed(src: dict[str, Any]) -> tuple[int, int, int | None]:
    """``max_tokens``, ``n`` and ``seed`` of a request body (or its ``sampling_params``), validated as vLLM does."""
    max_tokens = _number(src, "max_tokens", DEFAULT_MAX_TOKENS, int)
    if max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    n = _number(src, "n", 1, int)
    if n < 1:
        raise ApiError(f"n must be at least 1, got {n}.", param="n")
    seed = src.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(f"seed must be an integer, got {seed!r}.", param="seed")
    return max_tokens, n, seed


def _number(body: dict[str, Any], key: str, default: float, kind: type = float) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
    ):
        raise ApiError(
            f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}.", param=key
        )
    return kind(value)


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{key} must be a boolean, got {value!r}.", param=key)
    return value


def _prompts(body: dict[str, Any], ctx: ModelContext) -> list[list[int]]:
    """Normalize ``prompt`` (str, list[str], list[int], list[list[int]]) to token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise ApiError(
            "prompt must be a string, an array of strings, an array of token ids or an array of "
            "token-id arrays.",
            param="prompt",
        )
    out = []
    for p in prompts:
        if isinstance(p, str):
            p = list(ctx.tokenizer(p, add_special_tokens=True)["input_ids"])
        if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise ApiError("each prompt must be a string or an array of token ids.", param="prompt")
        if not p:
            raise ApiError("The decoder prompt cannot be empty", param="prompt")
        bad = [t for t in p if t < 0 or t >= ctx.vocab_size]
        if bad:
            raise ApiError(
                f"Token id {max(bad) if max(bad) >= 0 else min(bad)} is out of vocabulary", param="prompt"
            )
        out.append(p)
    return out


def _check_unsupported(body: dict[str, Any]) -> None:
    for key, neutral in _UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and value != neutral and value not in ([], {}, ""):
            raise ApiError(
                f"{key}={value!r} is not supported by the embedded server (asyncgrpo); use a vLLM "
                "server (server.backend=vllm) for it.",
                param=key,
            )


def _sampling(body: dict[str, Any], ctx: ModelContext) -> SamplingParams:
    d = ctx.defaults
    temperature = _number(body, "temperature", d.get("temperature", 1.0))
    top_p = _number(body, "top_p", d.get("top_p", 1.0))
    top_k = _number(body, "top_k", d.get("top_k", 0), int)
    min_p = _number(body, "min_p", d.get("min_p", 0.0))
    penalty = _number(body, "repetition_penalty", d.get("repetition_penalty", 1.0))
    if not math.isfinite(temperature) or temperature < 0:
        raise ApiError(f"temperature must be non-negative, got {temperature}.", param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise ApiError(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
    if top_k < -1:
        raise ApiError(f"top_k must be 0 (disable), or at least 1, got {top_k}.", param="top_k")
    if not 0.0 <= min_p <= 1.0:
        raise ApiError(f"min_p must be in [0, 1], got {min_p}.", param="min_p")
    if not math.isfinite(penalty) or penalty <= 0:
        raise ApiError(
            f"repetition_penalty must be greater than zero, got {penalty}.", param="repetition_penalty"
        )
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=max(top_k, 0), min_p=min_p, repetition_penalty=penalty
    )


def stop_token_ids(src: dict[str, Any]) -> list[int]:
    """``stop_token_ids`` of a request body (or its ``sampling_params``), validated as vLLM does."""
    stop_ids = src.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
    ):
        raise ApiError(f"stop_token_ids must contain only integers, got {stop_ids}.", param="stop_token_ids")
    return stop_ids


def _check_length(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """vLLM's checks: the prompt must leave room for one token; prompt + max_tokens must fit max_model_len."""
    if prompt_len >= max_model_len:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            param="input_tokens",
        )
    if prompt_len + max_tokens > max_model_len:
        raise ApiError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {prompt_len} input tokens ({max_tokens} > "
            f"{max_model_len} - {prompt_len}). (parameter=max_tokens, value={max_tokens})",
            param="max_tokens",
        )


def parse_completion_request(body: Any, ctx: ModelContext) -> CompletionPlan:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model != ctx.served_name:
        raise ApiError(
            f"The model `{model}` does not exist.", status=404, err_type="NotFoundError", param="model"
        )
    _check_unsupported(body)
    prompts = _prompts(body, ctx)
    max_tokens, n, seed = counts_and_seed(body)
    seed = None if seed == -1 else seed
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _number(body, "logprobs", 0, int)
        if logprobs < -1:
            raise ApiError(f"logprobs must be non-negative or -1, got {logprobs}.", param="logprobs")
        requested = ctx.vocab_size if logprobs == -1 else logprobs
        if requested > ctx.max_logprobs:
            raise ApiError(
                f"Requested sample logprobs of {requested}, which is greater than max allowed: "
                f"{ctx.max_logprobs}",
                param="logprobs",
            )
        logprobs = requested
    stop_ids = stop_token_ids(body)
    prompt_logprobs = parse_prompt_logprobs(body.get("prompt_logprobs"), ctx)
    params = _sampling(body, ctx)
    ignore_eos = _flag(body, "ignore_eos", False)
    requests = []
    for p in prompts:
        _check_length(len(p), max_tokens, ctx.max_model_len)
        requests.append(
            GenerationRequest(
                prompt_ids=p,
                max_tokens=max_tokens,
                params=params,
                n=n,
                seed=seed,
                num_logprobs=logprobs or 0,
                prompt_logprobs=prompt_logprobs,
                stop_token_ids=tuple(stop_ids),
                ignore_eos=ignore_eos,
            )
        )
    return CompletionPlan(
        requests=requests,
        logprobs=logprobs,
        tokens_as_ids=_flag(body, "return_tokens_as_token_ids", False),
        return_token_ids=_flag(body, "return_token_ids", False),
        skip_special_tokens=_flag(body, "skip_special_tokens", True),
    )


def _clamp(lp: float) -> float:
    return max(lp, LOGPROB_FLOOR) if not math.isnan(lp) else LOGPROB_FLOOR


def _logprobs_block(c: Completion, plan: CompletionPlan, ctx: ModelContext) -> dict[str, Any]:
    """OpenAI completions logprobs: sampled token first in each top entry, then the top N (at most N + 1 keys)."""

    def key(t: int) -> str:
        return f"token_id:{t}" if plan.tokens_as_ids else ctx.token_string(t)

    tokens = [key(t) for t in c.token_ids]
    top: list[dict[str, float]] = []
    for i, tok in enumerate(tokens):
        entry = {tok: _clamp(c.logprobs[i])}
        for tid, lp in c.top[i] if c.top else ():
            entry.setdefault(key(tid), _clamp(lp))
        top.append(entry)
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "text_offset": offsets,
        "token_logprobs": [_clamp(x) for x in c.logprobs],
        "tokens": tokens,
        "top_logprobs": top,
    }


def _text(c: Completion, plan: CompletionPlan, ctx: ModelContext) -> str:
    ids = (
        c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
    )  # the stop token is not part of the text
    return ctx.tokenizer.decode(ids, skip_special_tokens=plan.skip_special_tokens)


def build_completion_response(
    plan: CompletionPlan, results: Sequence[Sequence[Completion]], ctx: ModelContext
) -> dict[str, Any]:
    choices = []
    completion_tokens = 0
    for req, completions in zip(plan.requests, results):
        for c in completions:
            completion_tokens += len(c.token_ids)
            choices.append(
                {
                    "index": len(choices),
                    "text": _text(c, plan, ctx),
                    "logprobs": _logprobs_block(c, plan, ctx) if plan.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": prompt_logprobs_entries(req.prompt_ids, c.prompt_scores, ctx),
                    "token_ids": list(c.token_ids) if plan.return_token_ids else None,
                    "prompt_token_ids": list(req.prompt_ids) if plan.return_token_ids else None,
                }
            )
    prompt_tokens = sum(len(r.prompt_ids) for r in plan.requests)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.served_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
        },
        "system_fingerprint": None,
        "kv_transfer_params": None,
    }
