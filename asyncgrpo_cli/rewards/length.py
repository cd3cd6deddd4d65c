"""Length-based rewards: distance to a target token count, and the tiny task's toy digits reward."""

from __future__ import annotations

from typing import Any

from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.rewards.format import completion_text


class LengthReward:
    """Reward ``-|len(completion_ids) - target_length| / target_length``: 0 at the target, -1 at 0 or 2x.

    A callable class instance (not a closure), so it pickles into the rollout process.
    """

    def __init__(self, target_length: int = 64):
        if not isinstance(target_length, int) or isinstance(target_length, bool) or target_length <= 0:
            raise UserError(
                f"reward 'length': target_length ({target_length!r}) must be a positive integer number of tokens"
            )
        self.target_length = target_length
        self.__name__ = "length_reward"  # reward metrics are named after the function

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        t = self.target_length
        return [-abs(len(ids) - t) / t for ids in completion_ids]

    def __repr__(self) -> str:
        return f"LengthReward(target_length={self.target_length})"


def digits_reward(completions: list, **kwargs: Any) -> list[float]:
    """Fraction of the completion's characters that are digits (0.0 for an empty completion)."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        rewards.append(sum("0" <= ch <= "9" for ch in text) / len(text) if text else 0.0)
    return rewards
