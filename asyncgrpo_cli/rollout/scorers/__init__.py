"""Scorers: what becomes of a finished group. The rollout loop generates; a scorer decides what is trained.

The loop hands every finished ``RolloutGroup`` (its G rollouts, their training sequences, the dataset row's
columns) to one scorer, and queues what comes back: stamped samples, or a drop reason the trainer counts as a
resolved prompt. Admission, generation, queueing and completion metrics stay in the loop; rewards, advantages,
the drop rule and per-group reward metrics are the scorer's.

Registered scorers (``asyncgrpo plugins``, kind ``scorer``):

- ``grpo`` (``grpo.GroupScorer``): the sum of reward sources, group-normalized advantages, zero-signal groups
  dropped (rules in ``grpo.py``).

Adding a scorer (e.g. distillation, in a sibling module ``distill.py``):

1. Write one class with ``name`` and ``async def score(self, group, compute_advantages=None) -> ScoredGroup``,
   built as ``cls(ctx: ScorerContext)`` (``base.py`` holds the contract). Stamp every sample you return
   (``advantage``, ``group_id``, ``prompt_seq``, ``model_version``, ``reward``, ``group_num_samples`` = how many
   samples the group queues); return ``ScoredGroup([], "zero_std" | "no_samples")`` to queue nothing. Run
   blocking work on ``ctx.executor``, and add per-group metrics to ``ctx.metrics``::

       class DistillScorer:
           name = "distill"

           def __init__(self, ctx: ScorerContext):
               self.metrics = ctx.metrics

           async def score(self, group, compute_advantages=None):
               samples = [s for seqs in group.completions_sequences for s in seqs]
               for s in samples:
                   s.group_id, s.prompt_seq = group.group_id, group.prompt_seq
                   s.model_version, s.group_num_samples = group.model_version, len(samples)
               return ScoredGroup(samples, None if samples else "no_samples")

2. Register it in ``asyncgrpo_cli/registry.py`` (``("scorer", "distill", "module:Class", "one line")``), or
   from user code with ``@register("scorer", "distill")``.
3. Select it on the rollout loop: ``AsyncRolloutLoop.scorer_name`` (default ``"grpo"``) names a registered
   scorer or a ``module:Class``; a loop subclass sets its own (``rollout.loop=my_module:MyLoop``).
4. Test it on plain data: build it with a ``ScorerContext`` and a ``MetricWindow``, ``await score(group)``
   on a hand-made ``RolloutGroup`` (``tests/test_scoring.py`` does this for ``grpo``).
"""

from asyncgrpo_cli.rollout.scorers.base import AdvantageHook, ScoredGroup, Scorer, ScorerContext

__all__ = ["AdvantageHook", "ScoredGroup", "Scorer", "ScorerContext"]
