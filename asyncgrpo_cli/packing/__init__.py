"""Packing rows for the trainer: packers (``sequence``, ``tree``) and the planners that fill their rows.

Imports nothing at package import time; :func:`planner_for` imports the planner it names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from asyncgrpo_cli.errors import UserError

if TYPE_CHECKING:
    from asyncgrpo_cli.protocols import Packer


def planner_for(packer: Packer) -> type:
    """The planner class whose cost model matches ``packer``: its ``planner`` attribute ("module:Class").

    ``SequencePacker`` -> ``TokenBudgetPlanner`` (Σ L tokens, Σ L² cost); ``TreePacker`` ->
    ``TreeBudgetPlanner`` (unique tokens under the row's trie; ``GroupTreeBudgetPlanner`` under group tries when
    ``packing.share_across_groups`` is false). Every packer declares one
    (:class:`~asyncgrpo_cli.protocols.Packer`); a user packer whose rows are plain concatenations names
    ``asyncgrpo_cli.packing.planner:TokenBudgetPlanner``.
    """
    try:
        target = packer.planner
    except AttributeError:
        target = None
    if not isinstance(target, str) or ":" not in target:
        raise UserError(
            f"packing.kind: packer {type(packer).__name__} declares no planner: give it a class attribute "
            "planner = 'module:Class' (see asyncgrpo_cli.protocols.Packer; for concatenated rows "
            "'asyncgrpo_cli.packing.planner:TokenBudgetPlanner')"
        )
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
