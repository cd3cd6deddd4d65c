"""``prompt_logprobs``: a scored prefill, and the response entries vLLM builds from it.

What vLLM 0.33 does (``vllm/v1/worker/gpu_model_runner.py::_get_prompt_logprobs_dict``, and Model Runner V2's
``vllm/v1/worker/gpu/sample/prompt_logprob.py``), mirrored here:

- the scores are ``Sampler.compute_logprobs(logits)``: ``log_softmax`` in float32 of the model's raw logits over
  the full vocabulary. Prompt tokens never go through the sampler, so temperature, penalties, top-k/top-p/min-p
  do not apply whatever the request asks ("processed_*" and "raw_*" logprobs modes give the same prompt scores;
  the embedded server's "processed_logprobs" mode changes nothing here);
- position ``i`` (0-based, ``i < L - 1``) scores prompt token ``i + 1``: its log-prob, the top N of the row, and
  its rank ``count(logprobs >= logprob of the token)`` (1-based, ties counted, ``Sampler.gather_logprobs``);
- a request with ``prompt_logprobs`` skips *reading* the prefix cache (``SamplingParams.skip_reading_prefix_cache``
  defaults to True for it) so every position is computed; its KV is still written to the cache;
- the response (``vllm/logprobs.py::append_logprobs_for_next_position``) is a list aligned with the prompt, first
  entry null, then ``{token_id: {"logprob", "rank", "decoded_token"}}`` holding the actual token first and then the
  top N in order; an actual token that is in the top N keeps its first place and takes the top-N rank (its index
  there, 1-based). Keys are plain token ids (``dict[int, Logprob]`` serialized by pydantic): ``return_tokens_as_
  token_ids`` does not change them. ``-inf`` becomes ``-9999.0`` (``clamp_prompt_logprobs``);
- ``decoded_token`` is ``tokenizer.decode([id])`` with the leading spaces of a Metaspace (SentencePiece) piece
  restored (``convert_ids_list_to_tokens``); a piece ending in U+FFFD (a byte-fallback fragment) is re-decoded
  after up to 4 preceding prompt tokens, as ``LogprobsProcessor._correct_decoded_token`` does, else ``""``.

The prefill is run one prompt at a time in chunks of positions through the model's own forward (so a model's
logit scaling or soft-capping applies), which bounds memory at ``[chunk, vocab]`` float32 logits per step. A
hybrid model's linear-attention layers carry their state from one chunk to the next in transformers' cache, as
its own chunked prefill does (no padding: one prompt).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from asyncgrpo_cli.embedded.api import ApiError, ModelContext
from asyncgrpo_cli.embedded.kvcache import RowKV, _cache_kwarg, cache_row, linear_layers

CHUNK_ELEMENTS = 1 << 24
"""Logit elements per scoring chunk (64 MiB of float32): the chunk is ``max(1, CHUNK_ELEMENTS // vocab)``
positions (vLLM's MRV2 uses 1024 positions)."""
LOGPROB_FLOOR = -9999.0


@dataclass
class PromptScores:
    """Scores of prompt tokens ``1 .. L-1``: row ``i`` is position ``i`` predicting token ``i + 1``."""

    token_logprobs: torch.Tensor  # float32 [L-1]
    ranks: torch.Tensor  # int64 [L-1]
    top_ids: torch.Tensor  # int64 [L-1, N]
    top_logprobs: torch.Tensor  # float32 [L-1, N]


def score_rows(logits: torch.Tensor, targets: torch.Tensor, num: int) -> tuple[torch.Tensor, ...]:
    """vLLM's ``compute_logprobs`` + ``gather_logprobs`` on ``[n, V]`` logits: (target log-probs, ranks, top ids,
    top log-probs)."""
    lp = logits.float().log_softmax(dim=-1)
    tok = lp.gather(-1, targets[:, None])
    ranks = (lp >= tok).sum(-1)
    top_lp, top_ids = torch.topk(lp, num, dim=-1)
    return tok[:, 0], ranks, top_ids, top_lp


def scored_prefill(
    model: torch.nn.Module, prompt: Sequence[int], num: int, chunk: int | None = None
) -> tuple[RowKV, torch.Tensor, PromptScores]:
    """Prefill one prompt in chunks of positions, scoring every prompt token; return its KV, the last-position
    logits ``[V]`` (float32, CPU) and the scores (on the CPU)."""
    device = next(model.parameters()).device
    ids = torch.tensor(list(prompt), dtype=torch.int64)
    n = len(ids)
    vocab = model.get_output_embeddings().weight.shape[0]
    chunk = chunk or max(1, CHUNK_ELEMENTS // vocab)
    cache = DynamicCache(config=model.config)
    parts: list[tuple[torch.Tensor, ...]] = []
    last = None
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        q = torch.arange(start, end)
        mask = q[:, None] >= torch.arange(end)[None, :]
        out = model(
            input_ids=ids[None, start:end].to(device),
            attention_mask=mask[None, None].to(device),
            position_ids=q[None].to(device),
            use_cache=True,
            **{_cache_kwarg(type(model)): cache},
        )
        logits = out.logits[0]
        last = logits[-1].float().cpu()
        stop = min(end, n - 1)  # the last prompt position predicts the first generated token
        if stop > start:
            targets = ids[start + 1 : stop + 1].to(logits.device)
            parts.append(tuple(t.cpu() for t in score_rows(logits[: stop - start], targets, num)))
        del out, logits
    row = cache_row(cache, 0, 0, linear_layers(model))
    if parts:
        tok, ranks, top_ids, top_lp = (torch.cat(x) for x in zip(*parts))
    else:
        tok, ranks = torch.empty(0), torch.empty(0, dtype=torch.int64)
        top_ids, top_lp = torch.empty((0, num), dtype=torch.int64), torch.empty((0, num))
    return row, last, PromptScores(tok, ranks, top_ids, top_lp)  # type: ignore[arg-type]


def parse_prompt_logprobs(value: Any, ctx: ModelContext, param: str = "prompt_logprobs") -> int | None:
    """Validate a request's ``prompt_logprobs`` as vLLM does; return the top-N (-1 resolved to the vocab).

    ``param`` is ``prompt_logprobs`` on ``/v1/completions`` (the protocol's own messages) and
    ``sampling_params.prompt_logprobs`` on ``/inference/v1/generate`` (``SamplingParams``' messages)."""
    if value is None:
        return None
    if isinstance(value, bool):
        value = int(value)  # SamplingParams: prompt_logprobs=True means 1
    if not isinstance(value, (int, float)) or not float(value).is_integer():
        raise ApiError(f"`{param}` must be an integer.", param=param)
    value = int(value)
    if value < -1:
        raise ApiError(
            "`prompt_logprobs` must be a positive value or -1."
            if param == "prompt_logprobs"
            else f"prompt_logprobs must be non-negative or -1, got {value}.",
            param=param,
        )
    requested = ctx.vocab_size if value == -1 else value
    cap = ctx.vocab_size if ctx.max_logprobs == -1 else ctx.max_logprobs
    if requested > cap:
        raise ApiError(
            f"Requested prompt logprobs of {requested}, which is greater than max allowed: {cap}", param=param
        )
    return requested


def prompt_logprobs_entries(
    prompt: Sequence[int], scores: PromptScores | None, ctx: ModelContext
) -> list[dict[str, dict[str, Any]] | None] | None:
    """The response's ``prompt_logprobs`` list (vLLM's ``PromptLogprobs`` as serialized to JSON)."""
    if scores is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = [None]
    tok_lp, ranks = scores.token_logprobs.tolist(), scores.ranks.tolist()
    top_ids, top_lp = scores.top_ids.tolist(), scores.top_logprobs.tolist()
    prompt = [int(t) for t in prompt]
    for k in range(1, len(tok_lp) + 1):  # entry k scores prompt[k]
        context = prompt[max(1, k - 4) : k]  # vLLM: the first keys of the last 4 entries (not the null one)
        ids = [prompt[k], *top_ids[k - 1]]
        lps = [tok_lp[k - 1], *top_lp[k - 1]]
        entry: dict[str, dict[str, Any]] = {}
        for rank, t, lp in zip([ranks[k - 1], *range(1, len(ids))], ids, lps):
            entry[str(t)] = {
                "logprob": LOGPROB_FLOOR if lp == float("-inf") else lp,
                "rank": rank,
                "decoded_token": None if ctx.tokenizer is None else _decoded(t, context, ctx),
            }
        out.append(entry)
    return out


def _decoded(token_id: int, context: list[int], ctx: ModelContext) -> str:
    """vLLM's ``decoded_token`` of ``token_id`` after the prompt tokens ``context`` (see the module doc)."""
    tok = ctx.tokenizer
    text = ctx.token_string(token_id) or ""
    marker = _space_marker(tok)
    if marker is not None:
        raw = tok.convert_ids_to_tokens([token_id])[0] or ""
        missing = (len(raw) - len(raw.lstrip(marker))) - (len(text) - len(text.lstrip(" ")))
        text = " " * missing + text if missing > 0 else text
    if not text.endswith("\ufffd"):
        return text
    for n in range(1, min(len(context), 4) + 1):
        ctx_ids = context[-n:]
        full = tok.decode(ctx_ids + [token_id])
        if full.endswith("\ufffd"):
            continue
        clean_end = len(ctx_ids)
        while clean_end > 0 and tok.decode([ctx_ids[clean_end - 1]]).endswith("\ufffd"):
            clean_end -= 1
        prefix = tok.decode(ctx_ids[:clean_end]) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
        common = 0
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def _space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character of a fast tokenizer's pre-tokenizer (vLLM's
    ``get_leading_space_marker``), cached on the tokenizer; None for ByteLevel and the others."""
    cached = getattr(tokenizer, "_asyncgrpo_space_marker", "")
    if cached != "":
        return cached
    result = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
        except Exception:
            pre = {}
        subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        for sub in subs:
            if sub.get("type") == "Metaspace":
                result = sub.get("replacement", "\u2581")
                break
    try:
        tokenizer._asyncgrpo_space_marker = result
    except AttributeError:
        pass
    return result
