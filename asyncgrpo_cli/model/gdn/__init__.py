"""Gated-DeltaNet (linear attention) layers of hybrid models under sequence and tree packing: see ``layer.py``."""

from __future__ import annotations

from typing import Any

PLAN_KWARG = "asyncgrpo_gdn_plan"


def recurrence_kwargs(model: Any, row: Any) -> dict[str, Any]:
    """The decoder keyword arguments a packed ``row`` needs for ``model``'s linear-attention layers: the row's
    recurrence plan when :func:`~asyncgrpo_cli.model.gdn.layer.install` gave the model packed forwards, else none."""
    taps = getattr(model, "_asyncgrpo_gdn_taps", None)
    if taps is None:
        return {}
    from asyncgrpo_cli.model.gdn.plan import build_plan

    return {PLAN_KWARG: build_plan(row.leave, taps)}
