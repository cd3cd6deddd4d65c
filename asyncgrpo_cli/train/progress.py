"""Which prompts are done, for resume and for epoch counting.

A prompt (identified by its position ``prompt_seq`` in the run's prompt stream) is *resolved* when every sample
its group put on the queue has been trained or dropped (stale, oversize), or when the rollout process reports it
produced no sample (zero-std group, rejected by ``filter_prompt``). The resume position is the low-water mark:
the first unresolved prompt; prompts above it that are already resolved are saved too, so a resumed run neither
repeats nor skips a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptTracker:
    low_water: int = 0
    resolved_above: set[int] = field(default_factory=set)
    consumed_count: int = 0
    """Prompts resolved since the start of training (across resumes)."""
    _remaining: dict[int, int] = field(default_factory=dict)

    def on_sample_done(self, prompt_seq: int, group_num_samples: int) -> None:
        """One sample of ``prompt_seq`` was trained or dropped."""
        left = self._remaining.get(prompt_seq, group_num_samples) - 1
        if left <= 0:
            self._remaining.pop(prompt_seq, None)
            self.resolve(prompt_seq)
        else:
            self._remaining[prompt_seq] = left

    def resolve(self, prompt_seq: int) -> None:
        if prompt_seq < self.low_water or prompt_seq in self.resolved_above:
            return
        self.consumed_count += 1
        self.resolved_above.add(prompt_seq)
        while self.low_water in self.resolved_above:
            self.resolved_above.remove(self.low_water)
            self.low_water += 1

    def state(self) -> dict[str, Any]:
        return {
            "prompt_index": self.low_water,
            "resolved_above": sorted(self.resolved_above),
            "trained_prompt_count": self.consumed_count,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PromptTracker:
        return cls(
            low_water=int(state.get("prompt_index", 0)),
            resolved_above=set(int(x) for x in state.get("resolved_above", [])),
            consumed_count=int(state.get("trained_prompt_count", 0)),
        )
