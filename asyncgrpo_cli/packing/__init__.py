"""Packing rows for the trainer: packers (``sequence``, ``tree``) and the planners that fill their rows.

Imports nothing at package import time; :func:`planner_for` imports the planner it names.
"""

from __future__ import annotations

import importlib
from typing import Any

DEFAULT_PLANNER = "asyncgrpo_cli.packing.planner:TokenBudgetPlanner"


def planner_for(packer: Any) -> type:
    """The planner class whose cost model matches ``packer``: its ``planner`` attribute ("module:Class").

    ``SequencePacker`` -> ``TokenBudgetPlanner`` (Σ L tokens, Σ L² cost); ``TreePacker`` ->
    ``TreeBudgetPlanner`` (unique tokens under group tries). A packer that names none (a user plugin) gets
    the sequence planner, whose Σ L token count never underestimates what a row forwards.
    """
    target = getattr(packer, "planner", DEFAULT_PLANNER)
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
