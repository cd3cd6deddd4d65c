"""Distillation scoring: a finished rollout's teacher scores become its sample's ``teacher_topk`` extra.

Rules:

1. one sample per rollout, no group baseline: advantage 0 (the JSD loss reads the teacher, not an advantage);
2. the teacher's rows (``Rollout.extras[TEACHER_TOPK]``, one per completion token, from the loop) are mapped to
   the sample's trained tokens by position in the sequence; a position the teacher reported no candidate for
   stays in the sample as context (forwarded, not trained: it counts in ``batch/masked_token_frac`` and not in
   the loss normalizer);
3. a sample left with no trained token is not queued (``no_samples``);
4. reward functions, when configured, are only logged (``reward``, ``rewards/<name>/mean``): a reader sees
   the student's task accuracy move while it is trained toward the teacher.

Metrics: ``teacher_logprob`` (the teacher's mean log-prob of the student's sampled tokens, at temperature 1:
rises as the student's samples move toward what the teacher would write) and
``rollout/teacher_unscored_token_frac`` (completion tokens without a teacher candidate).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from asyncgrpo_cli.rollout.scorers.base import AdvantageHook, ScoredGroup, ScorerContext
from asyncgrpo_cli.rollout.scorers.grpo import GroupScorer, sum_sources
from asyncgrpo_cli.samples import TEACHER_TOPK, RolloutGroup, TeacherTopK, TrainingSequence


def sampled_logprobs(sample: TrainingSequence) -> np.ndarray:
    """The teacher's log-prob of each trained (sampled) token of ``sample``: its column in the teacher rows."""
    extra = sample.token_extras[TEACHER_TOPK]
    realized = sample.input_ids[sample.train_mask][:, None]
    hit = extra.ids == realized
    return np.where(hit.any(axis=1), np.where(hit, extra.logprobs, -np.inf).max(axis=1), np.nan)


def attach_teacher(sample: TrainingSequence, scores: TeacherTopK, start: int) -> int:
    """Give ``sample`` its teacher rows: ``scores`` row ``j`` scores the token at position ``start + j``. Trained
    tokens without a candidate become context. Returns how many trained tokens had none."""
    trained = np.flatnonzero(sample.train_mask)
    rows = trained - start
    if rows.size and (rows.min() < 0 or rows.max() >= len(scores)):
        raise RuntimeError(
            f"the teacher scored positions {start}..{start + len(scores) - 1} but the sample trains positions "
            f"{int(trained.min())}..{int(trained.max())}: distillation scores single-turn rollouts"
        )
    ids, lps, who = scores.ids[rows], scores.logprobs[rows], np.asarray(scores.teacher)[rows]
    has = (ids >= 0).any(axis=1) if ids.size else np.zeros(rows.size, dtype=bool)
    if not has.all():
        lost = trained[~has]
        sample.train_mask = sample.train_mask.copy()
        sample.train_mask[lost] = False
        sample.sampler_logprobs = sample.sampler_logprobs.copy()
        sample.sampler_logprobs[lost] = 0.0
        if sample.sampling_mask is not None:
            sample.sampling_mask = sample.sampling_mask.take(np.flatnonzero(has))
    sample.token_extras[TEACHER_TOPK] = TeacherTopK(
        ids[has], lps[has], teacher=who[has], teacher_names=scores.teacher_names
    )
    return int((~has).sum())


class DistillScorer:
    """One sample per rollout carrying the teacher's scores; rewards only logged."""

    name: ClassVar[str] = "distill"

    def __init__(self, ctx: ScorerContext):
        self.metrics = ctx.metrics
        self._rewards = GroupScorer(ctx) if ctx.reward_funcs else None

    async def score(
        self, group: RolloutGroup, compute_advantages: AdvantageHook | None = None
    ) -> ScoredGroup:
        rewards = np.full(len(group.completions), np.nan)
        if self._rewards is not None:
            per_func = await self._rewards.reward_sources(group)
            rewards = sum_sources(per_func)
            self.metrics.extend("reward", rewards[~np.isnan(rewards)])
            for i, rf in enumerate(self._rewards.reward_funcs):
                row = per_func[i]
                self.metrics.extend(f"rewards/{rf.name}/mean", row[~np.isnan(row)])
        samples: list[TrainingSequence] = []
        unscored = total = 0
        for i, (rollout, seqs) in enumerate(zip(group.rollouts, group.completions_sequences, strict=True)):
            scores = rollout.extras.get(TEACHER_TOPK)
            if scores is None:
                raise RuntimeError(
                    "the distill scorer found no teacher scores on a rollout: use it with the distill rollout "
                    "loop (rollout.loop=distill), whose generate_one scores each completion"
                )
            start = len(rollout.turns[0].prompt_ids)
            for s in seqs:
                total += s.num_trained
                unscored += attach_teacher(s, scores, start)
                if s.num_trained == 0:
                    continue
                lp = sampled_logprobs(s)
                self.metrics.extend("teacher_logprob", lp[np.isfinite(lp)])
                s.advantage = 0.0
                s.group_id, s.prompt_seq, s.model_version = (
                    group.group_id,
                    group.prompt_seq,
                    group.model_version,
                )
                s.reward = float(rewards[i])
                samples.append(s)
        for s in samples:
            s.group_num_samples = len(samples)
        if total:
            self.metrics.add_rate("rollout/teacher_unscored_token_frac", unscored, total)
        return ScoredGroup(samples, None if samples else "no_samples")
