"""Log-prob head: the trainer's per-token log-probs, entropies and sampler-top-k log-probs for a packed row.

Only the positions in ``row.pred_index`` are projected through the LM head; logits of untrained positions are
never formed. With z = head(h[pred_index]) / temperature (fp32) and log Z = logsumexp(z):

    logprob[i]    = z[i, target_ids[i]] - log Z[i]
    entropy[i]    = log Z[i] - Σ_v softmax(z[i])_v z[i, v]          (no gradient: logged only)
    topk[i, j]    = z[i, topk_ids[i, j]] - log Z[i]                 (-inf where topk_ids[i, j] == -1)

The head is ``model.get_output_embeddings()`` (tied models share the embedding weight through it); the model's
``logit_scale`` (Cohere) and ``final_logit_softcapping`` (Gemma) are applied before the temperature, as its own
forward does. Positions are processed in chunks of ``CHUNK`` to bound the temporary [chunk, V] tensors. Autograd
keeps each chunk's logits for backward; a recomputing chunked head replaces this later behind the same signature.

The decoder body runs with ``use_cache=False`` and the row's 4D mask (see ``packing/sequence.py``); SDPA and eager
attention are supported, flash kernels are rejected because they would ignore the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncgrpo_cli.packing.row import PackedRow

CHUNK = 1024


@dataclass
class TokenStats:
    """Per trained token (N rows, aligned with the row's loss terms).

    ``logprobs`` float32 [N] (differentiable); ``entropy`` float32 [N] (detached); ``topk_logprobs`` float32
    [N, K] trainer log-probs of the sampler's top-k ids (differentiable, -inf at padding), None unless asked.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    topk_logprobs: torch.Tensor | None = None


def _decoder(model: nn.Module) -> nn.Module:
    """The decoder body of a causal LM (Qwen3ForCausalLM.model, LlamaForCausalLM.model, ...)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if decoder is None or decoder is model:
        raise TypeError(
            f"cannot find the decoder body of {type(model).__name__} (get_decoder / base_model_prefix)"
        )
    return decoder


def _head(model: nn.Module) -> nn.Module:
    """The output projection; tied models share the embedding weight through the same module."""
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (lm_head)")
    return head


def _logits(model: nn.Module, head: nn.Module, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / temperature, with the model's logit scale and final soft-capping where it has them."""
    z = head(hidden).float()
    scale = getattr(model.config, "logit_scale", None)
    if scale is not None:
        z = z * scale
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    return z / temperature


def _chunk_stats(
    z: torch.Tensor, targets: torch.Tensor, topk_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    log_z = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, targets[:, None]).squeeze(-1) - log_z
    with torch.no_grad():
        zd = z.detach()
        entropy = log_z.detach() - (torch.softmax(zd, dim=-1) * zd).sum(-1)
    topk = None
    if topk_ids is not None:
        topk = z.gather(-1, topk_ids.clamp(min=0)) - log_z[:, None]
        topk = topk.masked_fill(topk_ids < 0, float("-inf"))
    return logprobs, entropy, topk


def _attention_mask(model: nn.Module, row: PackedRow, dtype: torch.dtype) -> torch.Tensor:
    """The row's mask in the form the model's attention applies (transformers passes 4D masks through as-is).

    SDPA reads a bool mask as True = attend. Eager attention *adds* the mask to the scores, so it needs the
    additive form (0 / dtype min): a bool mask there is silently wrong. Flash / flex kernels ignore a dense mask.
    A 4D mask also replaces sliding-window masks, so samples must fit in the window.
    """
    impl = str(getattr(model.config, "_attn_implementation", ""))
    if impl not in ("sdpa", "eager"):
        raise ValueError(
            f"model.attn_implementation={impl!r} cannot apply a packed row's 4D mask: use sdpa or eager"
        )
    window = getattr(model.config, "sliding_window", None)
    layer_types = getattr(model.config, "layer_types", None)
    if window and (layer_types is None or "sliding_attention" in layer_types):
        if int(row.position_ids.max()) >= window:
            raise ValueError(
                f"a sample is longer than the model's sliding window ({window}): packing would be inexact"
            )
    if impl == "eager":
        return torch.zeros((), dtype=dtype, device=row.attention_mask.device).masked_fill(
            ~row.attention_mask, torch.finfo(dtype).min
        )
    return row.attention_mask


def token_logprobs(model: nn.Module, row: PackedRow, temperature: float, with_topk: bool) -> TokenStats:
    """Run the decoder on ``row`` and compute :class:`TokenStats` at its ``pred_index`` positions."""
    if temperature <= 0:
        raise ValueError(f"sampling.temperature must be positive for training log-probs, got {temperature}")
    decoder = _decoder(model)
    out = decoder(
        input_ids=row.input_ids,
        position_ids=row.position_ids,
        attention_mask=_attention_mask(model, row, model.dtype),
        use_cache=False,
    )
    hidden = out.last_hidden_state[0].index_select(0, row.pred_index)
    head = _head(model)
    parts = []
    for start in range(0, max(hidden.shape[0], 1), CHUNK):
        sl = slice(start, start + CHUNK)
        z = _logits(model, head, hidden[sl], temperature)
        parts.append(_chunk_stats(z, row.target_ids[sl], row.topk_ids[sl] if with_topk else None))
    logprobs, entropy, topk = (list(p) for p in zip(*parts, strict=True))
    return TokenStats(
        logprobs=torch.cat(logprobs),
        entropy=torch.cat(entropy),
        topk_logprobs=torch.cat(topk) if with_topk else None,
    )
