"""GRPO scoring: a finished group's rewards, its group-normalized advantages, the drop rule, and its samples.

Rules (reference section e):

1. a completion's reward is the sum, with weight 1, of every source that scored it: each reward function, the
   rollout's environment's ``get_reward()`` (one source per environment class) and ``Rollout.reward``; a source
   returning ``None`` is left out of that sum;
2. a completion no source scored is *unscored* (NaN): it is excluded from the group mean and std and gets
   advantage 0; so is a rollout marked ``Rollout.unscored`` (a harness that failed), whatever its sources say;
3. advantage = (r - mean) / std over the scored completions (population std, no epsilon: a kept group's std is
   above the tolerance of rule 4);
4. a group is dropped (``zero_std``) when fewer than two completions are scored, or when it has *zero variance*:
   ``std <= ZERO_STD_RTOL * max(1, max |r|)`` over the scored rewards, with ``ZERO_STD_RTOL = 1e-6``. Rewards equal
   up to float rounding (``0.1 + 0.2 + 0.3`` and ``0.6``; ``1`` and ``1 + 2e-9``) therefore count as equal
   instead of yielding advantages of +-1. The decision looks at rewards, not at the advantages
   ``compute_advantages`` returns.

A run whose groups almost all have zero variance trains on next to nothing and waits for the few groups that
still have signal (the task is solved, or out of reach): :class:`SignalWatch` warns when at least
``SATURATED_FRAC`` of the last ``SIGNAL_WINDOW`` groups were dropped, with their mean reward, at most once per
``SIGNAL_WINDOW`` groups.

Metrics per group: ``reward``, ``rewards/{name}/mean`` (a reward function's name, or an environment's class
name), ``reward_dropped``, ``frac_reward_zero_std``,
``rollout/groups_scored_count``, ``rollout/groups_dropped_count``, ``rollout/score_s``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import ClassVar

import numpy as np

from asyncgrpo_cli.rollout.rewards import call_reward_funcs
from asyncgrpo_cli.rollout.scorers.base import AdvantageHook, ScoredGroup, ScorerContext
from asyncgrpo_cli.samples import RolloutGroup, TrainingSequence

log = logging.getLogger(__name__)

ZERO_STD_RTOL = 1e-6
"""Rule 4: a group whose reward std is at most this times ``max(1, max |r|)`` has zero variance."""


def sum_sources(sources: np.ndarray) -> np.ndarray:
    """Rules 1-2: sum reward sources ``[num_sources, G]`` per completion, skipping NaN; all-NaN columns stay NaN."""
    if sources.size == 0:
        return np.full(sources.shape[1] if sources.ndim == 2 else 0, np.nan)
    scored_any = ~np.isnan(sources).all(axis=0)
    total = np.nansum(sources, axis=0)
    total[~scored_any] = np.nan
    return total


def environment_sources(group: RolloutGroup) -> tuple[list[str], np.ndarray]:
    """One reward source per environment class in the group: ``(class names, [num_classes, G])``, NaN where a
    rollout ran in another environment, in none, or its ``get_reward`` returned None."""
    names = sorted({r[0] for r in group.env_rewards if r is not None})
    out = np.full((len(names), len(group.completions)), np.nan)
    for j, entry in enumerate(group.env_rewards):
        if entry is not None and entry[1] is not None:
            out[names.index(entry[0]), j] = float(entry[1])
    return names, out


def _scored(rewards: np.ndarray) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    return r[~np.isnan(r)]


def _zero_variance(scored: np.ndarray) -> bool:
    return bool(scored.std() <= ZERO_STD_RTOL * max(1.0, float(np.abs(scored).max())))


def is_zero_signal(rewards: np.ndarray) -> bool:
    """Rule 4: True when the group must be dropped (fewer than two scored completions, or zero variance)."""
    r = _scored(rewards)
    return r.size < 2 or _zero_variance(r)


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """Rule 3: (r - mean) / std over scored completions; unscored (NaN) completions get 0, and so does every
    completion of a zero-signal group (rule 4)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    adv = np.zeros_like(rewards)
    if is_zero_signal(rewards):
        return adv
    scored = ~np.isnan(rewards)
    r = rewards[scored]
    adv[scored] = (r - r.mean()) / r.std()
    return adv


def group_std(rewards: np.ndarray) -> float:
    """Population std of the scored rewards (NaN when none is scored)."""
    r = _scored(rewards)
    return float(r.std()) if r.size else math.nan


SIGNAL_WINDOW = 32
SATURATED_FRAC = 0.9


class SignalWatch:
    """Warns when nearly every recent group is dropped for zero variance (see the module docstring)."""

    def __init__(self, window: int = SIGNAL_WINDOW, frac: float = SATURATED_FRAC):
        self.window, self.frac = window, frac
        self._recent: deque[tuple[bool, float]] = deque(maxlen=window)
        self._since_warning = window
        self.warnings = 0

    def observe(self, dropped: bool, mean_reward: float) -> None:
        self._recent.append((dropped, mean_reward))
        self._since_warning += 1
        if len(self._recent) < self.window or self._since_warning < self.window:
            return
        drops = [r for d, r in self._recent if d]
        if len(drops) < self.frac * self.window:
            return
        self._since_warning = 0
        self.warnings += 1
        scored = [r for r in drops if not math.isnan(r)]
        if not scored:
            log.warning(
                "%d of the last %d groups had no scored rollout (every reward NaN or the rollout unscored, e.g. a "
                "harness that fails every time: harness/*): they give no gradient, and the trainer waits for the "
                "few that do: stop the run, and fix the rewards or the harness",
                len(drops),
                self.window,
            )
            return
        log.warning(
            "%d of the last %d groups had rewards without variance (frac_reward_zero_std): they give no gradient, "
            "and the trainer waits for the few that do. Their mean reward is %.3g (the best possible: the task is "
            "solved; the worst: it is out of reach): stop the run, or change the data or the rewards",
            len(drops),
            self.window,
            sum(scored) / len(scored),
        )


class GroupScorer:
    """GRPO: reward functions plus ``Rollout.reward``, group-normalized advantages, zero-signal groups dropped."""

    name: ClassVar[str] = "grpo"

    def __init__(self, ctx: ScorerContext):
        self.reward_funcs = ctx.reward_funcs
        self.metrics = ctx.metrics
        self.executor = ctx.executor
        self.signal = SignalWatch()

    def advantages(self, group: RolloutGroup) -> np.ndarray:
        """The default ``compute_advantages``: rule 3 on ``group.rewards``."""
        return group_advantages(group.rewards)

    async def score(
        self, group: RolloutGroup, compute_advantages: AdvantageHook | None = None
    ) -> ScoredGroup:
        t0 = time.monotonic()
        G = len(group.completions)
        per_func = await self.reward_sources(group)
        env_names, env_src = environment_sources(group)
        per_func = np.concatenate([per_func, env_src], axis=0)
        rollout_src = np.array([np.nan if r is None else float(r) for r in group.rollout_rewards])[None, :]
        group.rewards = sum_sources(np.concatenate([per_func, rollout_src], axis=0))
        group.rewards[np.asarray(group.unscored, dtype=bool)] = np.nan  # rule 2 for a failed rollout
        hook = compute_advantages or self.advantages
        advantages = np.asarray(hook(group), dtype=np.float64)
        if advantages.shape != (G,):
            raise RuntimeError(f"compute_advantages returned shape {advantages.shape}; expected ({G},)")
        dropped = is_zero_signal(group.rewards)
        scored = _scored(group.rewards)
        self.signal.observe(dropped, float(scored.mean()) if scored.size else math.nan)
        self.metrics.add("rollout/score_s", time.monotonic() - t0)
        self._record(group, per_func, [rf.name for rf in self.reward_funcs] + env_names, dropped)
        if dropped:
            return ScoredGroup([], "zero_std")
        samples = self._stamp(group, advantages, per_func, [rf.name for rf in self.reward_funcs] + env_names)
        return ScoredGroup(samples, None if samples else "no_samples")

    async def reward_sources(self, group: RolloutGroup) -> np.ndarray:
        """``[num_funcs, G]``: every reward function's value per completion (NaN for None). Rollouts marked
        unscored are not shown to the functions (a harness that died may have left no completion to read); they
        get NaN."""
        kwargs = {
            "prompts": group.prompts,
            "completions": group.completions,
            "completion_ids": group.completions_ids,
            **group.reward_kwargs,
        }
        n = len(group.completions)
        keep = [i for i, unscored in enumerate(group.unscored) if not unscored]
        if len(keep) == n:
            return await call_reward_funcs(self.reward_funcs, kwargs, n, group.row_index, self.executor)
        out = np.full((len(self.reward_funcs), n), np.nan)
        if keep:
            part = {k: [v[i] for i in keep] for k, v in kwargs.items()}
            out[:, keep] = await call_reward_funcs(
                self.reward_funcs, part, len(keep), group.row_index, self.executor
            )
        return out

    def _stamp(
        self, group: RolloutGroup, advantages: np.ndarray, per_func: np.ndarray, names: list[str]
    ) -> list[TrainingSequence]:
        std = group_std(group.rewards)
        func_std = {name: group_std(per_func[i]) for i, name in enumerate(names)}
        samples = []
        for i, seqs in enumerate(group.completions_sequences):
            for s in seqs:
                s.advantage = float(advantages[i])
                s.group_id = group.group_id
                s.prompt_seq = group.prompt_seq
                s.model_version = group.model_version
                s.reward = float(group.rewards[i])
                s.reward_group_std = std
                s.reward_func_group_std = func_std
                samples.append(s)
        for s in samples:
            s.group_num_samples = len(samples)
        return samples

    def _record(self, group: RolloutGroup, per_func: np.ndarray, names: list[str], dropped: bool) -> None:
        m = self.metrics
        scored = _scored(group.rewards)
        m.extend("reward", scored)
        for i, name in enumerate(names):
            m.extend(f"rewards/{name}/mean", _scored(per_func[i]))
        m.add("frac_reward_zero_std", float(dropped))
        m.add("rollout/groups_scored_count", 1)
        m.add("rollout/groups_dropped_count", float(dropped))
        if dropped and scored.size:
            m.add("reward_dropped", float(scored.mean()))
