"""What generation produced, as metrics: per turn (candidate sets), per rollout (turns, forks), per group
(completion lengths, truncation, duplicates). Reward metrics are the scorer's (``rollout/scorers/``)."""

from __future__ import annotations

from typing import Any

from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.samples import CandidateSets, Rollout, RolloutGroup, TurnRecord


def record_sampling_mask(m: MetricWindow, turn: TurnRecord) -> None:
    """rollout/sampling_mask_* metrics of one turn (token-weighted over the window)."""
    n = len(turn.output_ids)
    sets = turn.output_sampling_mask
    if not isinstance(sets, CandidateSets):
        sets = CandidateSets.empty(n) if sets is None else CandidateSets.coerce(sets)
    with_set = sets.num_with_set
    m.add_rate("rollout/sampling_mask_frac", with_set, n)
    m.add_rate("rollout/sampling_mask_overflow_frac", sets.num_overflow, n)
    m.add_rate("rollout/sampling_mask_invalid_frac", sets.num_invalid, n)
    if with_set:
        m.add_rate("rollout/sampling_mask_size_mean", sets.ids.shape[0], with_set)
        m.add("rollout/sampling_mask_size_max", int(sets.sizes.max()))


def record_rollout(m: MetricWindow, rollout: Rollout, num_samples: int, drift_tokens: list[Any]) -> None:
    """rollout/turns_*, samples_per_rollout, fork_frac and drift_tokens_* of one rollout."""
    m.add("rollout/turns_mean", len(rollout.turns))
    m.add("rollout/turns_max", len(rollout.turns))
    m.add("rollout/samples_per_rollout", num_samples)
    for d in drift_tokens:
        m.add("rollout/fork_frac", float(d > 0))
        m.add("rollout/drift_tokens_mean", d)
        m.add("rollout/drift_tokens_max", d)


def record_completions(m: MetricWindow, group: RolloutGroup) -> None:
    """completions/* metrics of one group: lengths, terminated lengths, clipped ratio, duplicates."""
    seen: set[tuple[int, ...]] = set()
    for r in group.rollouts:
        key = tuple(t for turn in r.turns for t in (*turn.prompt_ids, -1, *turn.output_ids))
        m.add("completions/duplicate_frac", float(key in seen))
        seen.add(key)
        n = len(r.completion_ids)
        m.add("completions/mean_length", n)
        m.add("completions/min_length", n)
        m.add("completions/max_length", n)
        terminated = bool(r.turns) and r.turns[-1].finish_reason == "stop"
        m.add("completions/clipped_ratio", float(not terminated))
        if terminated:
            m.add("completions/mean_terminated_length", n)
            m.add("completions/min_terminated_length", n)
            m.add("completions/max_terminated_length", n)
