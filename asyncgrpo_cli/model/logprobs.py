"""Log-prob head: the trainer's per-token log-probs, entropies and sampler-top-k log-probs for a packed row.

Only the positions in ``row.pred_index`` are projected through the LM head. With z = head(h[pred_index]) /
temperature (fp32) and log Z = logsumexp(z):

    logprob[i]    = z[i, target_ids[i]] - log Z[i]
    entropy[i]    = log Z[i] - Σ_v softmax(z[i])_v z[i, v]          (no gradient: logged only)
    topk[i, j]    = z[i, cand[i, j]] - log Z[i]                     (-inf where cand[i, j] == -1)

with ``cand = row.candidate_ids``, the ids of the row's top-k token extras (the sampler's: ``sampler_topk``).

The head is ``model.get_output_embeddings()`` (tied models share the embedding weight through it); the model's
``logit_scale`` (Cohere) and ``final_logit_softcapping`` (Gemma) are applied before the temperature, as its own
forward does. The projection is :func:`asyncgrpo_cli.model.head.token_stats` (``model.lm_head_kernel``): on CUDA
the fused Triton kernels of ``model/fused_head.py``, else the chunked head's tiles of
positions x vocabulary entries (sized per device: ``chunked_head.tile_shape``) with an online logsumexp in fp32,
recomputed in backward, so no [positions, vocab] logits are ever formed or kept. ``support_ids`` (optional, [N, C], -1 padding) renormalizes
over each position's sampling candidate set (top-k / top-p masks returned by the server).

The decoder body runs with ``use_cache=False`` and the row's attention rendered for the model's kernel: a dense
4D mask for SDPA / eager, a block-sparse flex ``BlockMask`` for flex attention (``model/flex.py``), both from the
row's DFS intervals; flash kernels are rejected because they would ignore the mask. Gated-DeltaNet layers of
hybrid models get the row's recurrence plan (``model/gdn``: convolution over path ancestors, state per segment).
With ``router`` (an MoE model with a router aux-loss coefficient, ``model/router.py``) the decoder also records its
router logits and the row's load-balancing loss is returned as ``aux_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncgrpo_cli.model.chunked_head import check_ids
from asyncgrpo_cli.model.flex import FLEX_IMPLS, row_block_mask
from asyncgrpo_cli.model.gdn import layer_masks, recurrence_kwargs
from asyncgrpo_cli.model.head import token_stats
from asyncgrpo_cli.model.head_types import LogitTransform
from asyncgrpo_cli.model.router import RouterAux, router_decoder_kwargs, row_aux_loss
from asyncgrpo_cli.packing.row import PackedRow


@dataclass
class TokenStats:
    """Per trained token (N rows, aligned with the row's loss terms).

    ``logprobs`` float32 [N] (differentiable); ``entropy`` float32 [N] (detached); ``topk_logprobs`` float32
    [N, K] trainer log-probs of the row's top-k extra ids (``row.candidate_ids``: the sampler's top-k;
    differentiable, -inf at padding), None unless asked or when the row has none. ``aux_loss`` float32 0-d: the
    row's MoE router load-balancing loss (differentiable, ``model/router.py``), None when not computed.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    topk_logprobs: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


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


def _head(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight [V, H] and bias of the output projection; tied models share the embedding weight through it.

    The chunked head reads the weight directly instead of calling the module, so the module must be a plain
    ``nn.Linear`` without forward hooks (a PEFT adapter or an offloading hook on ``lm_head`` would be bypassed).
    """
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (lm_head)")
    if not isinstance(head, nn.Linear) or head._forward_hooks or head._forward_pre_hooks:
        raise TypeError(
            f"the chunked LM head reads lm_head.weight directly, but {type(model).__name__}'s lm_head is a "
            f"{type(head).__name__}{' with forward hooks' if isinstance(head, nn.Linear) else ''}: "
            "keep lm_head a plain nn.Linear (no adapter on it)"
        )
    return head.weight, head.bias


def check_row(model: nn.Module, row: PackedRow, with_topk: bool) -> None:
    """The checks :func:`token_logprobs` makes on ``row``'s tensors, where they are: the LM head's id checks
    (``chunked_head.check_ids``) and the sliding-window bound. On the host copies of a packed row, before they go
    to the GPU, they cost no device sync. ``with_topk``: the head will also score ``row.candidate_ids``."""
    check_ids(
        int(_head(model)[0].shape[0]),
        row.target_ids,
        row.candidate_ids if with_topk else None,
        row.support_ids,
    )
    _check_window(model, row)


def _check_window(model: nn.Module, row: PackedRow) -> None:
    """A 4D mask replaces a model's sliding-window masks, so every sample must fit in the window."""
    window = getattr(model.config, "sliding_window", None)
    layer_types = getattr(model.config, "layer_types", None)
    if window and (layer_types is None or "sliding_attention" in layer_types):
        if int(row.position_ids.max()) >= window:
            raise ValueError(
                f"a sample is longer than the model's sliding window ({window}): packing would be inexact"
            )


def _transform(model: nn.Module, temperature: float) -> LogitTransform:
    """The model's logit scale and final soft-capping where it has them, then 1 / temperature."""
    return LogitTransform(
        temperature=temperature,
        scale=getattr(model.config, "logit_scale", None),
        softcap=getattr(model.config, "final_logit_softcapping", None),
    )


def _attention_mask(model: nn.Module, row: PackedRow, dtype: torch.dtype, checked: bool) -> object:
    """The row's mask in the form the model's attention applies (transformers passes 4D masks through as-is).

    Flex attention gets a ``BlockMask`` (no dense mask is built). SDPA reads a bool mask as True = attend. Eager
    attention *adds* the mask to the scores, so it needs the additive form (0 / dtype min): a bool mask there is
    silently wrong. Flash kernels ignore a dense mask. A 4D mask also replaces sliding-window masks, so samples
    must fit in the window (checked here unless ``checked``: :func:`check_row` ran on the host copies).
    """
    impl = str(getattr(model.config, "_attn_implementation", ""))
    if impl not in ("sdpa", "eager", *FLEX_IMPLS):
        raise ValueError(
            f"model.attn_implementation={impl!r} cannot apply a packed row's attention mask: use auto, sdpa, "
            "eager or flex_attention"
        )
    if not checked:
        _check_window(model, row)  # a device sync for a row on the GPU
    if impl in FLEX_IMPLS:
        return row_block_mask(row.leave, impl)
    mask = row.attention_mask  # dense, built from row.leave on its device
    if impl == "eager":
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def token_logprobs(
    model: nn.Module,
    row: PackedRow,
    temperature: float,
    with_topk: bool,
    *,
    support_ids: torch.Tensor | None = None,
    router: RouterAux | None = None,
    head_kernel: str = "auto",
    row_checked: bool = False,
) -> TokenStats:
    """Run the decoder on ``row`` and compute :class:`TokenStats` at its ``pred_index`` positions.

    ``support_ids`` [N, C] (-1 padding; one row per trained token, aligned with ``row.target_ids``): each token's
    sampling candidate set; log-probs, entropies and top-k log-probs are then renormalized over it (a row of only
    -1 keeps the full vocabulary). None (the default) normalizes over the full vocabulary. ``router``: also compute
    the row's router aux loss (``TokenStats.aux_loss``). ``head_kernel``: ``model.lm_head_kernel`` (auto, torch,
    triton; see ``model/head.py``). ``row_checked``: :func:`check_row` ran on the row's host copies, so the
    head's device-side id check and the sliding-window check (host syncs in the middle of the forward) are skipped.
    """
    if temperature <= 0:
        raise ValueError(f"sampling.temperature must be positive for training log-probs, got {temperature}")
    decoder = _decoder(model)
    out = decoder(
        input_ids=row.input_ids,
        position_ids=row.position_ids,
        attention_mask=layer_masks(model, _attention_mask(model, row, model.dtype, row_checked)),
        use_cache=False,
        **recurrence_kwargs(model, row),
        **router_decoder_kwargs(router),
    )
    hidden = out.last_hidden_state[0].index_select(0, row.pred_index)
    weight, bias = _head(model)
    stats = token_stats(
        hidden,
        weight,
        row.target_ids,
        bias=bias,
        transform=_transform(model, temperature),
        candidate_ids=row.candidate_ids if with_topk else None,
        support_ids=support_ids,
        kernel=head_kernel,
        ids_checked=row_checked,
    )
    aux_loss = row_aux_loss(router, out, row)
    return TokenStats(stats.logprobs, stats.entropy, stats.candidate_logprobs, aux_loss)
