"""The shared vocabulary: what the rollout process produces and the trainer consumes.

A *rollout* is one complete conversation for a prompt, made of one or more *turns* (sampling requests,
:class:`TurnRecord`). A *group* (:class:`RolloutGroup`) holds the G rollouts of one prompt. A rollout becomes one
or more *training sequences* (samples, :class:`TrainingSequence`): token ids with a per-token train mask, the
sampler's log-probs and the advantage. Multi-turn rollouts whose re-rendered history drifts, or that interleave
conversations (a harness's sub-agents), give several samples; every generated token is trained in exactly one of them (``rollout/sequences.py``).

Per-token data a loss needs beyond that travels as named *extras*: ``TrainingSequence.token_extras[name]``, one
row per trained token, gathered by name into ``PackedRow.extras`` by every packer (``packing/row.py``). A loss
declares the names it reads (``Loss.needs``, ``protocols.py``); the trainer itself never looks inside. The first
extra is :data:`SAMPLER_TOPK` (a :class:`TopK`); a new one touches the code that produces it and the loss that
reads it.

Plain Python + numpy: everything here crosses the process boundary by pickling and imports no torch.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Self

SAMPLER_TOPK = "sampler_topk"
"""Extra name: the sampler's most likely tokens at each trained token (a :class:`TopK`), asked from the server
when the loss needs it (``sampling.num_sampler_logprobs`` of them; score centering)."""


TEACHER_TOPK = "teacher_topk"
"""Extra name: a teacher's scores of the student's sampled tokens (a :class:`TeacherTopK`), asked from the row's
teacher server by the distillation rollout loop (``teacher.top_k`` candidates per token; the JSD loss)."""


def _new_id() -> str:
    return uuid.uuid4().hex


@runtime_checkable
class TokenExtra(Protocol):
    """Per-token data a sample carries for a loss, beyond tokens, sampler log-probs and the advantage.

    Stored as ``TrainingSequence.token_extras[name]`` with one row per trained token (row ``j``: the ``j``-th
    trained token), and gathered by name into ``PackedRow.extras[name]`` by every packer, one row per loss term,
    in ``target_ids`` order (a tree packer maps it exactly as it maps sampler log-probs). A dataclass whose array
    fields are numpy on the sample; the packer turns each numpy field into a torch tensor of the same layout.
    ``samples.TopK`` is one (the ``sampler_topk`` extra).
    """

    def __len__(self) -> int:
        """Rows: the sample's trained tokens."""
        ...

    @classmethod
    def empty(cls, n: int) -> Self:
        """``n`` rows carrying nothing: stands in for a sample of the row that lacks this extra."""
        ...

    @staticmethod
    def concat(parts: Sequence[Self]) -> Self:
        """The rows of ``parts`` one after another (padded to a common width where rows have one)."""
        ...


@dataclass
class CandidateSets:
    """Sampling candidate sets (top-k / top-p / min-p "sampling masks"), one per token, stored compactly.

    With truncated sampling the server draws each token from a candidate set S (the tokens that survive top-k /
    top-p / min-p) and its processed log-probs are normalized over S, so the trainer renormalizes its own
    log-probs over the same S (reference section j). The server returns S for every generated token (vLLM's
    ``--return-sampling-mask``; the embedded server always can).

    CSR, the layout vLLM itself uses internally (``SamplingMaskLists``): ``ids`` int32 [total] holds the
    candidate ids of every token, concatenated; ``offsets`` int64 [n + 1]; set i is ``ids[offsets[i] :
    offsets[i + 1]]``. An **empty set means "not truncated"**: the token is normalized over the full vocabulary
    (greedy rows, requests without a filter, a set the server did not return, or one dropped by the cap). 4 bytes
    per candidate plus 8 per token, instead of ~36 bytes per candidate for nested Python lists.

    Limits. A set is bounded by ``top_k`` on vLLM (which refuses masks without top_k > 0) but can reach the whole
    vocabulary with top_p / min_p alone. Sets larger than ``sampling.max_mask_candidates`` are dropped when the
    response is parsed (:meth:`from_lists`): the token is then treated as un-truncated and counted in
    ``rollout/sampling_mask_overflow_frac``. On the trainer the sets of one packed row become a padded [N, C]
    int64 tensor (``PackedRow.support_ids``, C = the row's largest set), so the cap also bounds that tensor.

    ``num_overflow`` / ``num_invalid`` count the sets dropped (emptied) when built by :meth:`from_lists`: larger
    than the cap, or not containing the token actually sampled (a server that does not follow its own mask).

    Example:
        >>> sets = CandidateSets.from_lists([[5, 9, 2], None, [7]], max_size=2)  # the first is over the cap
        >>> len(sets), sets.to_lists(), sets.num_overflow
        (3, [[], [], [7]], 1)
        >>> sets.padded().tolist()
        [[-1], [-1], [7]]
    """

    ids: np.ndarray
    offsets: np.ndarray
    num_overflow: int = 0
    num_invalid: int = 0

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int32)
        self.offsets = np.asarray(self.offsets, dtype=np.int64)
        if self.offsets.ndim != 1 or self.offsets.shape[0] < 1 or self.offsets[0] != 0:
            raise ValueError(f"offsets must be a 1-D array starting at 0, got {self.offsets[:4]}...")
        if self.offsets[-1] != self.ids.shape[0] or (np.diff(self.offsets) < 0).any():
            raise ValueError(
                f"offsets must be non-decreasing and end at len(ids)={self.ids.shape[0]}, got {self.offsets[-1]}"
            )

    # -- building ---------------------------------------------------------------------------------------------
    @classmethod
    def empty(cls, n: int) -> CandidateSets:
        """``n`` empty sets (every token normalized over the full vocabulary)."""
        return cls(np.zeros(0, np.int32), np.zeros(n + 1, np.int64))

    @classmethod
    def from_lists(
        cls,
        sets: Sequence[Sequence[int] | None],
        max_size: int | None = None,
        sampled: Sequence[int] | None = None,
    ) -> CandidateSets:
        """Sets given as lists (a server's ``sampling_mask``; None = no set). Sets over ``max_size`` are emptied
        and counted in ``num_overflow``; with ``sampled`` (the token drawn at each position), sets that do not
        contain it are emptied and counted in ``num_invalid``."""
        sizes = np.fromiter((0 if s is None else len(s) for s in sets), dtype=np.int64, count=len(sets))
        overflow = sizes > max_size if max_size is not None else np.zeros(len(sets), bool)
        keep = (sizes > 0) & ~overflow
        parts = [np.asarray(s, dtype=np.int64) for s, k in zip(sets, keep) if k]
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        kept_sizes = np.where(keep, sizes, 0)
        invalid = np.zeros(len(sets), bool)
        if sampled is not None:
            if len(sampled) != len(sets):
                raise ValueError(f"{len(sets)} candidate sets for {len(sampled)} sampled tokens")
            owner = np.repeat(np.arange(len(sets)), kept_sizes)
            hit = ids == np.asarray(sampled, dtype=np.int64)[owner]
            invalid = keep & (np.bincount(owner[hit], minlength=len(sets)) == 0)
            if invalid.any():
                ids = ids[~invalid[owner]]
                kept_sizes = np.where(invalid, 0, kept_sizes)
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise ValueError("candidate token ids must be in [0, 2**31)")
        offsets = np.concatenate([[0], np.cumsum(kept_sizes)])
        return cls(ids, offsets, int(overflow.sum()), int(invalid.sum()))

    @classmethod
    def coerce(cls, value: CandidateSets | Sequence[Sequence[int] | None]) -> CandidateSets:
        """A ``CandidateSets`` as is; nested lists (what a custom rollout loop may record) converted."""
        return value if isinstance(value, CandidateSets) else cls.from_lists(value)

    @staticmethod
    def concat(parts: Sequence[CandidateSets]) -> CandidateSets:
        """The sets of ``parts`` one after another."""
        if not parts:
            return CandidateSets.empty(0)
        shifts = np.cumsum([0] + [p.ids.shape[0] for p in parts[:-1]])
        offsets = [np.zeros(1, np.int64)] + [p.offsets[1:] + s for p, s in zip(parts, shifts)]
        return CandidateSets(
            np.concatenate([p.ids for p in parts]),
            np.concatenate(offsets),
            sum(p.num_overflow for p in parts),
            sum(p.num_invalid for p in parts),
        )

    def take(self, index: np.ndarray | Sequence[int]) -> CandidateSets:
        """The sets at ``index`` (in that order), e.g. a turn's trained tokens."""
        index = np.asarray(index, dtype=np.int64)
        sizes = self.sizes[index]
        starts = np.repeat(self.offsets[:-1][index], sizes)
        within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        return CandidateSets(self.ids[starts + within], np.concatenate([[0], np.cumsum(sizes)]))

    # -- reading ----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def sizes(self) -> np.ndarray:
        """int64 [n]: the size of each set (0 = not truncated)."""
        return np.diff(self.offsets)

    @property
    def num_with_set(self) -> int:
        """Tokens that carry a candidate set."""
        return int((self.sizes > 0).sum())

    def to_lists(self) -> list[list[int]]:
        return [self[i].tolist() for i in range(len(self))]

    def padded(self) -> np.ndarray:
        """int64 [n, C] with -1 padding (C = the largest set; an empty set is a row of -1): ``support_ids``."""
        sizes = self.sizes
        out = np.full((len(self), int(sizes.max(initial=0))), -1, dtype=np.int64)
        rows = np.repeat(np.arange(len(self)), sizes)
        cols = np.arange(self.ids.shape[0]) - np.repeat(self.offsets[:-1], sizes)
        out[rows, cols] = self.ids
        return out


@dataclass
class TopK:
    """Per trained token, the K most likely tokens under some model with their log-probs (a token extra).

    ``ids`` int64 [n, K], -1 = no entry; ``logprobs`` float32 [n, K], -inf where the id is -1. Numpy arrays on a
    sample; on a packed row (``PackedRow.extras``) torch tensors of the same layout, the rows of every sample one
    after another, padded to the row's widest K. :data:`SAMPLER_TOPK` holds the sampler's; the trainer's head
    scores the ids of every ``TopK`` extra of a row for a loss that needs extras (``PackedRow.candidate_ids``).

    Example:
        >>> top = TopK(np.array([[7, 8], [5, -1]]), np.array([[-0.1, -2.0], [-0.2, -np.inf]], np.float32))
        >>> len(top), top.width
        (2, 2)
        >>> TopK.concat([top, TopK.empty(1)]).ids.tolist()  # a sample without one: rows of padding
        [[7, 8], [5, -1], [-1, -1]]
    """

    ids: Any
    logprobs: Any

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def width(self) -> int:
        """K: entries per row."""
        return int(self.ids.shape[1])

    @classmethod
    def empty(cls, n: int) -> TopK:
        """``n`` rows of width 0 (a sample that carries no top-k)."""
        return cls(np.full((n, 0), -1, dtype=np.int64), np.full((n, 0), -np.inf, dtype=np.float32))

    @staticmethod
    def concat(parts: Sequence[TopK]) -> TopK:
        """The rows of ``parts`` one after another, padded to the widest (id -1, log-prob -inf); a log-prob whose
        id is -1 is set to -inf."""
        for p in parts:
            if p.ids.ndim != 2 or p.ids.shape != p.logprobs.shape:
                raise ValueError(
                    f"top-k ids {p.ids.shape} and log-probs {p.logprobs.shape} must be [n, K] arrays of one shape"
                )
        k = max((p.width for p in parts), default=0)
        ids = [np.full((len(p), k), -1, dtype=np.int64) for p in parts]
        lps = [np.full((len(p), k), -np.inf, dtype=np.float32) for p in parts]
        for p, i, lp in zip(parts, ids, lps, strict=True):
            i[:, : p.width] = p.ids
            lp[:, : p.width] = np.where(p.ids >= 0, p.logprobs, -np.inf)
        if not parts:
            return TopK.empty(0)
        return TopK(np.concatenate(ids), np.concatenate(lps))


@dataclass
class TeacherTopK(TopK):
    """Per trained token, a teacher's sparse distribution over the student's vocabulary (the ``teacher_topk``
    extra).

    ``ids`` int64 [n, K+1] and ``logprobs`` float32 [n, K+1]: columns ``0..K-1`` hold the teacher's top-K by rank
    (column 0 = its top-1), column ``K`` the sampled (realized) token when it is outside that top-K (vLLM reports
    it with every position), else -1; -1 / -inf pad columns a teacher did not fill. Log-probs are the server's
    (full-vocabulary ``log_softmax`` at temperature 1). A row of only -1 is a position the teacher reported
    nothing for. ``teacher`` int64 [n] is the index of the teacher that scored the token in ``teacher_names``
    (the sorted ids of ``teacher.servers``, the same tuple on every sample of a run).

    Example:
        >>> t = TeacherTopK(np.array([[7, 8, 5]]), np.array([[-0.1, -2.5, -4.0]], np.float32),
        ...                 teacher=np.array([1]), teacher_names=("code", "math"))
        >>> t.width, t.teacher_names[int(t.teacher[0])]
        (3, 'math')
        >>> TeacherTopK.concat([t, TeacherTopK.empty(1)]).ids.tolist()
        [[7, 8, 5], [-1, -1, -1]]
    """

    teacher: Any = None
    teacher_names: tuple[str, ...] = ("default",)

    def __post_init__(self) -> None:
        if self.teacher is None:
            self.teacher = np.zeros(len(self), dtype=np.int64)

    @classmethod
    def empty(cls, n: int) -> TeacherTopK:
        """``n`` rows of width 0 (a sample without teacher scores: every position masked out of the loss)."""
        base = TopK.empty(n)
        return cls(base.ids, base.logprobs, teacher=np.full(n, -1, dtype=np.int64), teacher_names=())

    @staticmethod
    def concat(parts: Sequence[TeacherTopK]) -> TeacherTopK:
        """Rows one after another, padded to the widest; every part must carry the same ``teacher_names`` (an
        empty part carries none)."""
        names = {p.teacher_names for p in parts if p.teacher_names}
        if len(names) > 1:
            raise ValueError(f"teacher scores of one row name different teacher sets: {sorted(names)}")
        top = TopK.concat(parts)
        teacher = (
            np.concatenate([np.asarray(p.teacher, dtype=np.int64) for p in parts])
            if parts
            else np.zeros(0, dtype=np.int64)
        )
        return TeacherTopK(top.ids, top.logprobs, teacher=teacher, teacher_names=next(iter(names), ()))


@dataclass
class TurnRecord:
    """One sampling request: the full prompt sent and the tokens the sampler produced.

    Example:
        >>> turn = TurnRecord(prompt_ids=[1, 2, 3], output_ids=[7, 5], output_log_probs=[-0.1, -0.2],
        ...                   output_sampler_logprobs=[{7: -0.1, 8: -2.0}, {5: -0.2}], finish_reason="stop")
        >>> len(turn.output_ids), turn.output_mask is None  # no mask: every output token is trained
        (2, True)
    """

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
    """One finished rollout, as returned by ``AsyncRolloutLoop.generate_one``.

    Example:
        >>> r = Rollout(completion=[{"role": "assistant", "content": "12"}], completion_ids=[7, 5],
        ...             turns=[TurnRecord([1, 2, 3], [7, 5], [-0.1, -0.2])])
        >>> len(r.turns), r.reward is None
        (1, True)
    """

    completion: list[dict[str, str]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    reward: float | None = None
    rollout_id: str = field(default_factory=_new_id)
    tool_call_count: int = 0
    """Tool calls made during the rollout."""
    tool_failure_count: int = 0
    """Failed tool calls: unknown tool, malformed call, the tool raised or timed out."""
    prompt: list[dict[str, Any]] | None = None
    """The prompt messages the rollout started from when they differ from the row's (an environment's
    ``reset`` added its task); None: the row's prompt."""
    env_reward: tuple[str, float | None] | None = None
    """(environment class name, its ``get_reward()``) for a rollout whose environment defines ``get_reward``."""
    unscored: str | None = None
    """Why the rollout cannot be scored (a harness that timed out, crashed, ...): its reward is NaN whatever
    the reward sources return (advantage 0, out of the group's mean and std). None: scored as usual."""
    extras: dict[str, Any] = field(default_factory=dict)
    """What a loop's hook attaches for its scorer, by name (the distillation loop: ``TEACHER_TOPK``, the
    teacher's scores of the completion tokens, one row per completion token)."""


@dataclass
class TrainingSequence:
    """One sample: the unit the loss is computed on.

    ``input_ids`` holds context and sampled tokens. ``train_mask[t] == 1`` marks a trained token ``t`` (predicted
    at position ``t - 1``); ``sampler_logprobs[t]`` is its sampler log-prob (0 where untrained).

    Per-trained-token data is aligned with the trained tokens in order: row ``j`` belongs to the ``j``-th trained
    token (the ``j``-th True of ``train_mask``), so each holds ``num_trained`` rows. ``sampling_mask`` holds one
    candidate set per trained token; ``token_extras[name]`` holds what a loss reads beyond tokens, log-probs and
    the advantage (e.g. ``token_extras[SAMPLER_TOPK]``, a :class:`TopK`). An extra is any
    :class:`TokenExtra` (``len``, ``empty(n)``, ``concat(parts)``); a sample lacking
    one that another sample of its row carries gets ``empty`` rows when packed.

    Example:
        >>> s = TrainingSequence(
        ...     input_ids=np.array([1, 2, 3, 7, 5]), train_mask=np.array([0, 0, 0, 1, 1], bool),
        ...     sampler_logprobs=np.array([0, 0, 0, -0.1, -0.2], np.float32), advantage=0.5,
        ...     token_extras={SAMPLER_TOPK: TopK(np.array([[7, 8], [5, 7]]), np.array([[-0.1, -2.0], [-0.2, -1.5]]))})
        >>> len(s), s.num_trained, len(s.token_extras[SAMPLER_TOPK])
        (5, 2, 2)
    """

    input_ids: np.ndarray  # int64 [L]
    train_mask: np.ndarray  # bool [L]
    sampler_logprobs: np.ndarray  # float32 [L]
    advantage: float = 0.0
    sampling_mask: CandidateSets | None = None  # per trained token (top-k/top-p/min-p candidate sets)
    token_extras: dict[str, TokenExtra] = field(default_factory=dict)
    """Name -> per-trained-token extra (``num_trained`` rows), gathered by name into ``PackedRow.extras``."""
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
    """The ``num_generations`` rollouts of one prompt, scored together (one entry per rollout).

    Example:
        >>> r = Rollout([], [7, 5], [TurnRecord([1, 2, 3], [7, 5], [-0.1, -0.2])])
        >>> g = RolloutGroup(prompts=[[{"role": "user", "content": "6+6?"}]], reward_kwargs={"solution": ["12"]},
        ...                  completions=[r.completion], completions_ids=[r.completion_ids],
        ...                  completions_sequences=[[]],
        ...                  model_version=3, group_id=0, row_index=0, rollout_rewards=[None],
        ...                  rollouts=[r])
        >>> len(g.rollouts), g.rewards is None  # rewards are filled when the group is scored
        (1, True)
    """

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

    @property
    def tool_call_counts(self) -> list[int]:
        """Tool calls per rollout."""
        return [r.tool_call_count for r in self.rollouts]

    @property
    def tool_failure_counts(self) -> list[int]:
        """Failed tool calls per rollout."""
        return [r.tool_failure_count for r in self.rollouts]

    @property
    def env_rewards(self) -> list[tuple[str, float | None] | None]:
        """Per rollout, (environment class name, reward) when its environment defines ``get_reward``, else None."""
        return [r.env_reward for r in self.rollouts]

    @property
    def unscored(self) -> list[bool]:
        """Per rollout, whether it is unscored whatever its reward sources say (``Rollout.unscored``)."""
        return [r.unscored is not None for r in self.rollouts] or [False] * len(self.completions)


@dataclass
class PromptResolved:
    """Queue marker: a prompt produced no samples (dropped zero-std group, or rejected by ``filter_prompt``).

    It still counts toward the epoch and lets the trainer advance its resume position.

    Example:
        >>> PromptResolved(prompt_seq=41, reason="zero_std")
        PromptResolved(prompt_seq=41, reason='zero_std')
    """

    prompt_seq: int
    reason: str  # "zero_std" | "filtered" | "no_samples"


@dataclass
class RolloutDone:
    """Queue marker: the rollout process has generated every prompt it was asked for (epochs exhausted).

    Example:
        >>> RolloutDone(num_prompts=128)
        RolloutDone(num_prompts=128)
    """

    num_prompts: int
