"""``POST /inference/v1/generate``: vLLM's tokens-in / tokens-out route, with the per-token sampling mask.

vLLM registers this route with ``--enable-scale-out`` (``vllm/entrypoints/scale_out/token_in_token_out``) and fills
``choices[i].sampling_mask`` only with ``--return-sampling-mask``; the embedded server always serves both and
advertises the mask as ``model_config.return_sampling_mask: true`` in ``/server_info`` (the same key vLLM's
config dump has).

Request: ``{"token_ids": [int, ...], "sampling_params": {vLLM SamplingParams}, "model"?, "request_id"?,
"return_token_ids"?, "output_mode": "tokens", "stream": false}``. Supported ``sampling_params``: ``n``,
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ``logprobs``,
``prompt_logprobs`` (the top-level ``prompt_logprobs``, as on ``/v1/completions``: ``prompt_logprobs.py``),
``stop_token_ids``, ``ignore_eos``, plus the text-only knobs that do not change tokens (``detokenize``,
``skip_special_tokens``, ...); any other non-neutral SamplingParams value is a 400, an unknown key too.

Response (``GenerateTokensResponse``): ``request_id`` (``generate-tokens-`` prefix), ``model``, ``created``,
``usage``, ``prompt_token_ids`` (with ``return_token_ids``), ``output_mode: "tokens"`` and per choice ``index``,
``finish_reason``, ``stop_reason``, ``token_ids``, ``sampling_mask`` and ``logprobs``:

    "logprobs": {"content": [{"token_id", "logprob", "rank",
                              "top_logprobs": [{"token_id", "logprob", "rank"}, ...]}, ...]}   (or null)
    "sampling_mask": [[candidate ids, ascending], ...]   one list per generated token, or null

``top_logprobs`` holds the sampled token first, then the top N (N or N + 1 entries, as vLLM 0.33); log-probs are
clamped to -9999.0. ``sampling_mask`` is the support of the processed distribution each token was drawn from
(``sampling.candidate_sets``), so ``logprob`` is normalized over exactly that set. Differences from vLLM: a
request that no filter truncates (greedy, or top_k = 0, top_p = 1, min_p = 0) gets ``sampling_mask: null``
where vLLM with ``--return-sampling-mask`` rejects it (it requires temperature > 0 and top_k > 0);
``weight_versions`` is always null (not tracked); streaming and ``output_mode: "text"`` are not supported.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.embedded.api import ApiError, ModelContext
from asyncgrpo_cli.embedded.completions import (
    _check_length,
    _clamp,
    _flag,
    _number,
    _sampling,
    counts_and_seed,
    stop_token_ids,
)
from asyncgrpo_cli.embedded.prompt_logprobs import parse_prompt_logprobs, prompt_logprobs_entries
from asyncgrpo_cli.embedded.requests import Completion, GenerationRequest

ROUTE = "/inference/v1/generate"
REQUEST_ID_PREFIX = "generate-tokens-"

_SUPPORTED = {
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "stop_token_ids",
    "ignore_eos",
}
# SamplingParams fields with no effect on the tokens (text handling, output plumbing): accepted, ignored.
_IGNORED = {
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "output_kind",
    "stream_interval",
    "skip_clone",
    "output_text_buffer_length",
    "flat_logprobs",
}
# SamplingParams fields the embedded server does not implement, with the value that means "not used".
_UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "watermarking": None,
    "stop": None,
    "min_tokens": 0,
    "prompt_logprob_start": None,
    "logprob_token_ids": None,
    "structured_outputs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "extra_args": None,
    "bad_words": None,
    "skip_reading_prefix_cache": None,
    "thinking_token_budget": None,
    "repetition_detection": None,
    "routed_experts_prompt_start": 0,
    "trace_decode_token_ids": None,
}


@dataclass
class GeneratePlan:
    request: GenerationRequest
    request_id: str
    logprobs: int | None
    return_token_ids: bool


def _token_ids(body: dict[str, Any], ctx: ModelContext) -> list[int]:
    ids = body.get("token_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise ApiError("token_ids must be a non-empty array of token ids.", param="token_ids")
    bad = [t for t in ids if t < 0 or t >= ctx.vocab_size]
    if bad:
        raise ApiError(f"Token id {bad[0]} is out of vocabulary", param="token_ids")
    return ids


def _check_sampling_keys(sp: dict[str, Any]) -> None:
    for key, value in sp.items():
        if key in _SUPPORTED or key in _IGNORED:
            continue
        if key not in _UNSUPPORTED:
            raise ApiError(
                f"sampling_params.{key} is not a SamplingParams field.", param=f"sampling_params.{key}"
            )
        if value is not None and value != _UNSUPPORTED[key] and value not in ([], {}, ""):
            raise ApiError(
                f"sampling_params.{key}={value!r} is not supported by the embedded server (asyncgrpo); use a "
                "vLLM server (server.backend=vllm) for it.",
                param=f"sampling_params.{key}",
            )


def parse_generate_request(body: Any, ctx: ModelContext) -> GeneratePlan:
    """Validate a ``/inference/v1/generate`` body (400 / 404 ``ApiError`` with vLLM-style messages)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model != ctx.served_name:
        raise ApiError(
            f"The model `{model}` does not exist.", status=404, err_type="NotFoundError", param="model"
        )
    if _flag(body, "stream", False):
        raise ApiError("stream=true is not supported by the embedded server.", param="stream")
    mode = body.get("output_mode", "tokens")
    if mode != "tokens":
        raise ApiError(
            f"output_mode={mode!r} is not supported by the embedded server (only 'tokens').",
            param="output_mode",
        )
    prompt = _token_ids(body, ctx)
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise ApiError(
            "sampling_params is required (vLLM SamplingParams as an object).", param="sampling_params"
        )
    _check_sampling_keys(sp)
    max_tokens, n, seed = counts_and_seed(sp)
    logprobs = sp.get("logprobs")
    if logprobs is not None:
        logprobs = _number(sp, "logprobs", 0, int)
        requested = ctx.vocab_size if logprobs == -1 else logprobs
        if logprobs < -1 or requested > ctx.max_logprobs:
            raise ApiError(
                f"Requested sample logprobs of {requested}, which is greater than max allowed: {ctx.max_logprobs}",
                param="logprobs",
            )
        logprobs = requested
    stop_ids = stop_token_ids(sp)
    _check_length(len(prompt), max_tokens, ctx.max_model_len)
    request = GenerationRequest(
        prompt_ids=prompt,
        max_tokens=max_tokens,
        params=_sampling(sp, ctx),
        n=n,
        seed=None if seed == -1 else seed,
        num_logprobs=logprobs or 0,
        prompt_logprobs=parse_prompt_logprobs(
            sp.get("prompt_logprobs"), ctx, param="sampling_params.prompt_logprobs"
        ),
        return_sampling_mask=True,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_flag(sp, "ignore_eos", False),
    )
    request_id = str(body.get("request_id") or uuid.uuid4().hex)
    return GeneratePlan(request, request_id, logprobs, _flag(body, "return_token_ids", False))


def _logprobs(c: Completion, n: int) -> dict[str, Any]:
    content = []
    for i, tok in enumerate(c.token_ids):
        entries = {tok: (_clamp(c.logprobs[i]), c.ranks[i] if i < len(c.ranks) else None)}
        for rank, (tid, lp) in enumerate(c.top[i] if c.top else (), start=1):
            entries.setdefault(tid, (_clamp(lp), rank))
        top = [{"token_id": t, "logprob": lp, "rank": r} for t, (lp, r) in list(entries.items())[: n + 1]]
        lp, rank = entries[tok]
        content.append({"token_id": tok, "logprob": lp, "rank": rank, "top_logprobs": top})
    return {"content": content}


def _sampling_mask(c: Completion) -> list[list[int]] | None:
    if c.sampling_mask is None or any(m is None for m in c.sampling_mask):
        return None
    return [m.tolist() for m in c.sampling_mask]


def build_generate_response(
    plan: GeneratePlan, completions: Sequence[Completion], ctx: ModelContext
) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(completions):
        choices.append(
            {
                "index": i,
                "finish_reason": c.finish_reason or "stop",
                "stop_reason": c.stop_reason,
                "token_ids": list(c.token_ids),
                "routed_experts": None,
                "sampling_mask": _sampling_mask(c),
                "weight_versions": None,
                "logprobs": _logprobs(c, plan.logprobs) if plan.logprobs is not None else None,
            }
        )
    prompt_tokens = len(plan.request.prompt_ids)
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "request_id": f"{REQUEST_ID_PREFIX}{plan.request_id}",
        "model": ctx.served_name,
        "created": int(time.time()),
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": prompt_logprobs_entries(
            plan.request.prompt_ids, completions[0].prompt_scores if completions else None, ctx
        ),
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": list(plan.request.prompt_ids) if plan.return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": choices,
    }
