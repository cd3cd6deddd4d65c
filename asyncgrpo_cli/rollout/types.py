"""The rollout data model: turns, rollouts, groups, and the training sequences (samples) they produce.

A *rollout* is one complete conversation for a prompt, made of one or more *turns* (sampling requests). A *group*
holds the G rollouts of one prompt. A rollout becomes one or more *training sequences* (samples): token ids with a
per-token train mask and the sampler's log-probs. Multi-turn rollouts whose re-rendered history drifts fork into
several samples; every generated token is trained in exactly one of them.

Everything here is plain Python + numpy: it crosses the process boundary by pickling and imports no torch.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncgrpo_cli.rollout.candidates import CandidateSets


def _new_id() -> str:
    return uuid.uuid4().hex


@dataclass
class TurnRecord:
    """One sampling request: the full prompt sent and the tokens the sampler produced."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    """Sampler log-prob of each output token (the server's processed log-probs). Required when trained."""
    output_mask: list[int] | None = None
    """1 = train, 0 = context only, per output token. None trains every output token."""
    output_sampling_mask: CandidateSets | list[list[int]] | None = None
    """Per output token, the token ids the sampler could draw from under top-k/top-p/min-p (its candidate set; an
    empty set means the full vocabulary); None: no sets (every token normalized over the full vocabulary).
    ``CandidateSets`` is the compact form the client records; nested lists are accepted from custom loops."""
    output_sampler_logprobs: list[dict[int, float]] | None = None
    """Per output token, the sampler's log-probs of its most likely tokens, keyed by token id."""
    finish_reason: str | None = None
    """'stop' (EOS or stop token), 'length' (max tokens) or 'abort'."""


@dataclass
class Rollout:
    """One finished rollout, as returned by ``AsyncRolloutLoop.generate_one``."""

    completion: list[dict[str, str]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    reward: float | None = None
    rollout_id: str = field(default_factory=_new_id)


@dataclass
class TrainingSequence:
    """One sample: the unit the loss is computed on.

    ``input_ids`` holds context and sampled tokens. ``train_mask[t] == 1`` marks a trained token ``t`` (predicted
    at position ``t - 1``); ``sampler_logprobs[t]`` is its sampler log-prob (0 where untrained). The sampler's top
    log-probs are stored only for trained tokens, in the order they appear: row ``j`` of ``topk_ids`` /
    ``topk_logprobs`` belongs to the ``j``-th trained token; missing entries are id -1 / log-prob -inf.
    ``sampling_mask`` likewise holds one candidate set per trained token (``rollout/candidates.py``).
    """

    input_ids: np.ndarray  # int64 [L]
    train_mask: np.ndarray  # bool [L]
    sampler_logprobs: np.ndarray  # float32 [L]
    advantage: float = 0.0
    topk_ids: np.ndarray | None = None  # int64 [n_trained, K]
    topk_logprobs: np.ndarray | None = None  # float32 [n_trained, K]
    sampling_mask: CandidateSets | None = None  # per trained token (top-k/top-p/min-p candidate sets)
    rollout_id: str = ""
    group_id: int = 0
    prompt_seq: int = 0
    """Position of the prompt in the run's prompt stream (epoch * len(dataset) + index); used for resume."""
    group_num_samples: int = 1
    """How many samples the group put on the queue (the trainer resolves the prompt when all are consumed)."""
    model_version: int = 0
    enqueued_at: float = 0.0
    """time.time() when the sample was put on the queue."""
    reward: float = float("nan")
    reward_group_std: float = float("nan")
    reward_func_group_std: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trained(self) -> int:
        return int(self.train_mask.sum())


@dataclass
class RolloutGroup:
    """The ``num_generations`` rollouts of one prompt, scored together (one entry per rollout)."""

    prompts: list[list[dict[str, str]]]
    reward_kwargs: dict[str, list[Any]]
    completions: list[list[dict[str, str]]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    model_version: int
    group_id: int
    row_index: int
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: np.ndarray | None = None
    prompt_seq: int = 0
    epoch: int = 0
    rollouts: list[Rollout] = field(default_factory=list)


@dataclass
class PromptResolved:
    """Queue marker: a prompt produced no samples (dropped zero-std group, or rejected by ``filter_prompt``).

    It still counts toward the epoch and lets the trainer advance its resume position.
    """

    prompt_seq: int
    reason: str  # "zero_std" | "filtered" | "no_samples"


@dataclass
class RolloutDone:
    """Queue marker: the rollout process has generated every prompt it was asked for (epochs exhausted)."""

    num_prompts: int
