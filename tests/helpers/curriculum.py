"""The reference's curriculum example (section p.3) as a rollout loop: stop sampling prompts the policy already
solves. Selected with ``rollout.loop=tests.helpers.curriculum:CurriculumRolloutLoop``; the cap is
``rollout.loop_options.pass_rate_cap``."""

from __future__ import annotations

import numpy as np

from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop


class CurriculumRolloutLoop(AsyncRolloutLoop):
    async def setup(self) -> None:
        self.pass_rates: dict[int, float] = {}

    def filter_prompt(self, row_index, row, epoch) -> bool:
        return self.pass_rates.get(row_index, 0.0) < float(self.options.get("pass_rate_cap", 0.9))

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(
                np.mean(scored > self.options.get("pass_threshold", 0.0))
            )
        return super().compute_advantages(group)


def even_rows_solved(completions, task_id, **kwargs):
    """1.0 for every completion of an even ``task_id`` (a solved prompt: pass rate 1), the digits reward for odd
    ones (below 1: pass rate ~0 at ``pass_threshold: 0.99``), so which prompts epoch 2 skips is known."""
    from asyncgrpo_cli.rewards.length import digits_reward

    digits = digits_reward(completions=completions, **kwargs)
    return [1.0 if int(t) % 2 == 0 else min(d, 0.98) for t, d in zip(task_id, digits, strict=True)]
