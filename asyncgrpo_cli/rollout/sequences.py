"""Turning a rollout's turns into training sequences (samples), with extend-or-fork reconciliation.

Every sample of a rollout stays open until the rollout ends. Each turn after the first extends the open sample with
the longest token sequence (its kept ids: prompts and outputs so far) that is a prefix of the turn's prompt, on a
tie the one a turn went into most recently: the prompt's tail after it becomes context, the sampled tokens become
trained tokens. A turn that no open sample is a prefix of starts a new sample (a fork: the chat template re-rendered
the history differently, or the agent started another conversation). So one conversation is one sample, and an agent
that interleaves conversations (sub-agents A and B: turns A1 B1 A2 B2) gets one sample per conversation, not one per
turn. Samples are emitted in the order they were created; every generated token is trained in exactly one.
``ReconcileStats``: ``transitions`` counts the turns after the first, ``forks`` those that extended no open sample,
and ``drift_tokens`` has one entry per transition: 0 when it extended a sample, else how many kept ids of the
previous turn's sample the prompt does not share (its length minus their common prefix).

The sampler's top log-probs (``TurnRecord.output_sampler_logprobs``) become the ``sampler_topk`` token extra when
``num_topk > 0`` (the loss needs them): the ``num_topk`` most likely entries of each trained token, best first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from asyncgrpo_cli.samples import SAMPLER_TOPK, CandidateSets, Rollout, TopK, TrainingSequence, TurnRecord


@dataclass
class ReconcileStats:
    transitions: int = 0
    forks: int = 0
    drift_tokens: list[int] = field(default_factory=list)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if diff.size else n


class _Builder:
    def __init__(self, num_topk: int):
        self.ids: list[int] = []
        self.mask: list[bool] = []
        self.lps: list[float] = []
        self.topk: list[dict[int, float] | None] = []
        self.masks: list[CandidateSets] = []  # per turn, its trained tokens' candidate sets
        self.num_topk = num_topk
        self.last_turn = -1  # index of the last turn that went into this sample

    def add_context(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        self.mask.extend([False] * len(ids))
        self.lps.extend([0.0] * len(ids))

    def add_turn_output(self, turn: TurnRecord) -> None:
        n = len(turn.output_ids)
        mask = turn.output_mask if turn.output_mask is not None else [1] * n
        lps = turn.output_log_probs
        if any(mask) and len(lps) != n:
            raise ValueError(
                f"TurnRecord has {n} output tokens but {len(lps)} output_log_probs: sampler log-probs are required "
                "for every trained token."
            )
        for j, tok in enumerate(turn.output_ids):
            trained = bool(mask[j])
            self.ids.append(int(tok))
            self.mask.append(trained)
            self.lps.append(float(lps[j]) if trained else 0.0)
            if trained:
                self.topk.append(turn.output_sampler_logprobs[j] if turn.output_sampler_logprobs else None)
        trained_idx = np.flatnonzero(np.asarray(mask, dtype=bool))
        if turn.output_sampling_mask is None:
            self.masks.append(CandidateSets.empty(trained_idx.size))
            return
        sets = CandidateSets.coerce(turn.output_sampling_mask)
        if len(sets) != n:
            raise ValueError(f"TurnRecord has {n} output tokens but {len(sets)} output_sampling_mask entries")
        self.masks.append(sets.take(trained_idx))

    def _sampling_mask(self) -> CandidateSets | None:
        """One set per trained token, in order; None when no token carries one."""
        sets = CandidateSets.concat(self.masks)
        return sets if sets.num_with_set else None

    def _sampler_topk(self) -> TopK | None:
        """The ``num_topk`` best sampler entries of each trained token (id -1 / -inf where fewer); None when
        not asked for or no trained token carries any."""
        if self.num_topk <= 0 or all(t is None for t in self.topk):
            return None
        k = self.num_topk
        topk = TopK(
            np.full((len(self.topk), k), -1, dtype=np.int64),
            np.full((len(self.topk), k), -np.inf, np.float32),
        )
        for i, entry in enumerate(self.topk):
            if not entry:
                continue
            best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]
            for j, (tok, lp) in enumerate(best):
                topk.ids[i, j] = tok
                topk.logprobs[i, j] = lp
        return topk

    def build(self) -> TrainingSequence | None:
        if not any(self.mask):
            return None
        topk = self._sampler_topk()
        return TrainingSequence(
            input_ids=np.asarray(self.ids, dtype=np.int64),
            train_mask=np.asarray(self.mask, dtype=bool),
            sampler_logprobs=np.asarray(self.lps, dtype=np.float32),
            sampling_mask=self._sampling_mask(),
            token_extras={} if topk is None else {SAMPLER_TOPK: topk},
        )


def _extends(kept: list[int], prompt: np.ndarray) -> bool:
    """Whether ``kept`` is a prefix of ``prompt``."""
    n = len(kept)
    return n <= prompt.size and bool(np.array_equal(prompt[:n], np.asarray(kept, dtype=np.int64)))


def rollout_to_sequences(rollout: Rollout, num_topk: int) -> tuple[list[TrainingSequence], ReconcileStats]:
    """Build the training sequences of one rollout (advantage and ids are attached by the caller)."""
    stats = ReconcileStats()
    builders: list[_Builder] = []  # every open sample, in creation order
    current: _Builder | None = None  # the sample the previous turn went into
    for i, turn in enumerate(rollout.turns):
        prompt = list(turn.prompt_ids)
        if current is None:
            current = _Builder(num_topk)
            current.add_context(prompt)
            builders.append(current)
        else:
            stats.transitions += 1
            arr = np.asarray(prompt, dtype=np.int64)
            prefixes = [b for b in builders if _extends(b.ids, arr)]
            if prefixes:
                best = max(prefixes, key=lambda b: (len(b.ids), b.last_turn))
                stats.drift_tokens.append(0)
                best.add_context(prompt[len(best.ids) :])
                current = best
            else:
                stats.forks += 1
                stats.drift_tokens.append(len(current.ids) - common_prefix_len(current.ids, prompt))
                current = _Builder(num_topk)
                current.add_context(prompt)
                builders.append(current)
        current.last_turn = i
        current.add_turn_output(turn)
    samples = [s for s in (b.build() for b in builders) if s is not None]
    for s in samples:
        s.rollout_id = rollout.rollout_id
    return samples, stats
