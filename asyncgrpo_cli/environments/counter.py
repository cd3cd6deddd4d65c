"""``IncrementEnv``: the reference's environment example (reach a target with an ``increment`` tool).

``reset`` draws a target from 1 to 6 (or takes the row's ``target`` column when the dataset has one) and returns
the task; ``increment(step)`` is the one tool; ``get_reward`` is 1.0 when the counter equals the target. One
instance serves many rollouts in turn (``reset`` clears it), never two at once.
"""

from __future__ import annotations

import random


class IncrementEnv:
    def __init__(self) -> None:
        self.counter = 0
        self.target = 0
        self._rng = random.Random()

    def reset(self, target: int | None = None, **kwargs) -> str:
        self.counter = 0
        self.target = int(target) if target is not None else self._rng.randint(1, 6)
        return f"Increment the counter by {self.target}."

    def increment(self, step: int) -> int:
        """Add a step to the counter.

        Args:
            step: How much to add to the counter.

        Returns:
            The counter after the increment.
        """
        self.counter += int(step)
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter == self.target)
