"""The scorer contract: what a scorer receives, what it returns, and the one method the rollout loop calls.

Typing only, plus two small data holders; nothing here imports a scorer. See the package docstring for the how-to.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.rewards import RewardFunction
from asyncgrpo_cli.samples import RolloutGroup, TrainingSequence

AdvantageHook = Callable[[RolloutGroup], np.ndarray]
"""``AsyncRolloutLoop.compute_advantages``: one advantage per rollout, in ``group.rewards`` order."""


@dataclass
class ScorerContext:
    """What the rollout loop hands a scorer when it builds it (once, in the rollout process)."""

    reward_funcs: list[RewardFunction]
    """The resolved ``rewards.funcs``."""
    metrics: MetricWindow
    """The loop's metric window: a scorer adds its per-group metrics here (they reach the trainer with the
    group's samples)."""
    executor: Executor | None
    """Threads for blocking work (sync reward functions); never block the event loop."""
    settings: Any
    """The loop's ``RolloutSettings`` (sampling, rollout options, server URL)."""


@dataclass
class ScoredGroup:
    """A scorer's verdict on one group."""

    samples: list[TrainingSequence]
    """Stamped samples, ready for the queue (advantage, group/prompt ids, version, rewards,
    ``group_num_samples``); empty when the group yields nothing to train."""
    drop_reason: str | None = None
    """Why nothing is queued, as reported to the trainer (``PromptResolved.reason``): ``"zero_std"`` or
    ``"no_samples"``; None when ``samples`` is non-empty."""


@runtime_checkable
class Scorer(Protocol):
    """Turns a finished group into training samples (or a drop). Built with ``cls(ctx: ScorerContext)``."""

    name: ClassVar[str]

    async def score(
        self, group: RolloutGroup, compute_advantages: AdvantageHook | None = None
    ) -> ScoredGroup:
        """Score ``group`` and stamp its samples. ``compute_advantages`` is the loop's hook; a scorer that has
        advantages calls it (the default hook delegates back to the scorer), one that has none ignores it."""
        ...
