"""Staleness control: the token allowance that paces generation, and the drop rule applied at consume time.

Generation is held to ``max(max_staleness, 1)`` optimizer steps of tokens: the trainer's step collector
(``train/batching.py``, the one owner of trainer-side pacing) publishes
``allowance = max(max_staleness, 1) * tokens consumed by the last step`` (before the first step it assumes every
row is full: ``token_budget * rows per step``), and the rollout process starts a new group only while the tokens
queued or in flight, plus the new group's expected tokens, stay within it (a group may always start when nothing
is outstanding, so a group larger than the allowance cannot stall generation). Tokens are counted as sample
tokens (prompt + completion) on both sides. Until the first group completes, the expected size of a group is
unknown, so groups start one at a time.

Independently, a sample whose policy version lags the trainer's by more than ``max_staleness`` weight updates is
dropped when the step collector pulls it. The rollout side of the allowance is ``rollout/admission.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def initial_allowance(max_staleness: int, token_budget: int, rows_per_step: int) -> int:
    return max(max_staleness, 1) * token_budget * rows_per_step


def step_allowance(max_staleness: int, tokens_consumed_by_step: int) -> int:
    return max(max_staleness, 1) * max(tokens_consumed_by_step, 1)


def is_stale(trainer_version: int, sample_version: int, max_staleness: int) -> bool:
    return trainer_version - sample_version > max_staleness


@dataclass
class AllowanceTracker:
    """Rollout-side accounting of tokens queued or in flight against the trainer's allowance.

    ``produced`` counts tokens of samples put on the queue; ``consumed`` (published by the trainer) counts tokens
    of samples it pulled, trained or dropped. In-flight groups count at the running per-rollout estimate.
    """

    produced: int = 0
    in_flight_groups: dict[int, int] = field(default_factory=dict)  # group id -> estimated tokens
    completed_groups: int = 0
    rollout_tokens_total: int = 0
    rollouts_total: int = 0

    def estimate_group(self, num_generations: int) -> int:
        if self.rollouts_total == 0:
            return 0
        return int(num_generations * self.rollout_tokens_total / self.rollouts_total)

    def outstanding(self, consumed: int) -> int:
        return self.produced - consumed + sum(self.in_flight_groups.values())

    def can_start(self, allowance: int, consumed: int, num_generations: int) -> bool:
        """Start a group only if its expected tokens still fit the allowance (or nothing is outstanding)."""
        if self.completed_groups == 0:
            return not self.in_flight_groups  # one group at a time until the first completes
        outstanding = self.outstanding(consumed)
        return outstanding <= 0 or outstanding + self.estimate_group(num_generations) <= allowance

    def start(self, group_id: int, num_generations: int) -> None:
        self.in_flight_groups[group_id] = self.estimate_group(num_generations)

    def finish(self, group_id: int, rollout_tokens: list[int], queued_tokens: int) -> None:
        """A group finished and was scored: ``queued_tokens`` of its samples went on the queue (0 if dropped)."""
        self.in_flight_groups.pop(group_id, None)
        self.completed_groups += 1
        self.rollout_tokens_total += sum(rollout_tokens)
        self.rollouts_total += len(rollout_tokens)
        self.produced += queued_tokens
