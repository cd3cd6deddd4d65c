"""Reward functions that misbehave on purpose (module level: they must pickle into the rollout process)."""


def exploding_reward(completions, **kwargs):
    raise RuntimeError("reward exploded on purpose")


def warning_reward(completions, **kwargs):
    """Scores 1 and logs a warning (from the rollout process: the trainer must show it)."""
    import logging

    logging.getLogger("my_pkg.rewards").warning("warning_reward saw %d completions", len(completions))
    return [1.0 if i % 2 else 0.0 for i in range(len(completions))]
