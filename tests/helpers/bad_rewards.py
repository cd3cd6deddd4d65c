"""Reward functions that misbehave on purpose (module level: they must pickle into the rollout process)."""


def exploding_reward(completions, **kwargs):
    raise RuntimeError("reward exploded on purpose")
