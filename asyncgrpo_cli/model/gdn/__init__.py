"""Gated-DeltaNet (linear attention) layers of hybrid models under sequence and tree packing: see ``layer.py``."""

from __future__ import annotations

from typing import Any

PLAN_KWARG = "asyncgrpo_gdn_plan"


def recurrence_kwargs(model: Any, row: Any) -> dict[str, Any]:
    """The decoder keyword arguments a packed ``row`` (a ``PackedRow``) needs for ``model``'s linear-attention
    layers: the row's recurrence plan when :func:`~asyncgrpo_cli.model.gdn.layer.install` gave the model packed
    forwards, else none. The plan is built from the row's host ``leave`` where it has one (``PackedRow.host_leave``:
    no read-back of the device's copy, so the host keeps running ahead of the GPU)."""
    taps = getattr(model, "_asyncgrpo_gdn_taps", None)
    if taps is None:
        return {}
    from asyncgrpo_cli.model.gdn.plan import build_plan

    host = row.host_leave
    return {PLAN_KWARG: build_plan(row.leave if host is None else host, taps, device=row.leave.device)}


def layer_masks(model: Any, mask: Any) -> Any:
    """The attention mask argument of a hybrid decoder: one entry per layer type (transformers' Qwen3.5 /
    Qwen3-Next decoders take such a dict as is), the row's mask for attention layers and None for linear ones.

    Passing the mask itself would make the decoder derive a recurrent-layer mask from it, which fails for a flex
    ``BlockMask``; the packed linear-attention forward reads the row's plan instead. Other models: ``mask``.
    """
    if getattr(model, "_asyncgrpo_gdn_taps", None) is None:
        return mask
    config = model.config
    types = getattr(config, "layer_types", None) or getattr(
        getattr(config, "text_config", None), "layer_types", ()
    )
    return {t: (None if "linear" in str(t) else mask) for t in dict.fromkeys(types)}
