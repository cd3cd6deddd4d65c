"""Streaming token-budget planner: samples in, micro-batches (one row of samples per rank) out.

One row per rank stays open. A sample of length L goes into the row that still fits it (row tokens + L <=
``token_budget``) and has the smallest running attention cost Σ L_i² (ties: lowest rank). When no row fits it,
the open micro-batch is emitted and fresh rows start with that sample. A sample longer than ``token_budget`` fits
no row: it is dropped with a warning and counted in ``dropped_oversize_count``.

Every emitted micro-batch has a non-empty row on every rank (an empty rank desyncs collectives). This needs no
extra rule: an empty row has cost 0 and fits any admissible sample, so the first ``num_ranks`` samples of a
micro-batch land on distinct ranks, and a sample can only fail to fit once every row holds something.

The work per sample is a scan of ``num_ranks`` Python integers (no numpy call: at a few microseconds per sample,
numpy's per-call overhead on such tiny arrays was most of the planning time); the per-row stats of a micro-batch
are computed once per row, when it is emitted. Token budgeting ignores per-device sample counts: samples per row
is whatever fits.
"""

from __future__ import annotations

import functools
import heapq
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from asyncgrpo_cli.samples import TrainingSequence

logger = logging.getLogger(__name__)


@dataclass
class MicroBatch:
    """One micro-batch: ``rows[rank]`` are the samples that rank packs, plus per-row stats for metrics.

    Per-row arrays (length num_ranks): ``samples_per_row``, ``tokens_per_row`` (forwarded tokens),
    ``trained_per_row`` (trained tokens), ``attn_cost_per_row`` (Σ L² of the row's samples).
    ``filler_ranks`` lists ranks whose row is a context-only filler (see ``TokenBudgetPlanner.flush``).
    """

    rows: list[list[TrainingSequence]]
    samples_per_row: np.ndarray
    tokens_per_row: np.ndarray
    trained_per_row: np.ndarray
    attn_cost_per_row: np.ndarray
    token_budget: int
    filler_ranks: tuple[int, ...] = ()

    @property
    def num_trained(self) -> int:
        """Trained tokens across all ranks (the micro-batch's share of the step's loss normalizer)."""
        return int(self.trained_per_row.sum())

    @property
    def row_imbalance(self) -> float:
        """max / mean row attention cost; 1.0 = perfectly balanced."""
        mean = float(self.attn_cost_per_row.mean())
        return float(self.attn_cost_per_row.max()) / mean if mean > 0 else 1.0

    @property
    def row_fill_frac(self) -> np.ndarray:
        """Forwarded tokens of each row / token_budget."""
        return self.tokens_per_row / self.token_budget


def context_only(sample: TrainingSequence) -> TrainingSequence:
    """A copy of ``sample`` with nothing trained (zero advantage, no top-k): forwarded for shape only."""
    return TrainingSequence(
        input_ids=sample.input_ids,
        train_mask=np.zeros_like(sample.train_mask, dtype=bool),
        sampler_logprobs=np.zeros_like(sample.sampler_logprobs),
        advantage=0.0,
        rollout_id=sample.rollout_id,
        group_id=sample.group_id,
        prompt_seq=sample.prompt_seq,
        model_version=sample.model_version,
    )


class Budgeted(Protocol):
    """A planner's budget and its count of dropped samples (:func:`refuse`)."""

    token_budget: int
    dropped_oversize_count: int


class Adds(Budgeted, Protocol):
    """What :func:`add_each` uses of a planner (a :class:`~asyncgrpo_cli.protocols.Planner`)."""

    def add(self, sample: TrainingSequence) -> MicroBatch | None: ...


def refuse(planner: Budgeted, length: int) -> None:
    """A sample ``planner`` cannot take: an empty one is an error; one longer than its ``token_budget`` is dropped,
    counted in its ``dropped_oversize_count`` and warned about."""
    if length == 0:
        raise ValueError("empty sample (no tokens) given to the planner")
    planner.dropped_oversize_count += 1
    logger.warning(
        "dropping a sample of %d tokens: longer than packing.token_budget (%d); raise "
        "packing.token_budget or lower sampling.max_completion_length",
        length,
        planner.token_budget,
    )


@dataclass
class GroupAdded:
    """What :func:`add_group` did with a run of samples."""

    batch: MicroBatch | None
    """The micro-batch the last sample taken closed (that sample opens the next one), or None."""
    taken: int
    """Samples taken from the front of the run: all of them, unless one closed a micro-batch (then up to and
    including it; the rest were not looked at, as if they had not arrived yet)."""
    dropped: list[int] = field(default_factory=list)
    """Positions in the run of the samples taken that were dropped as oversize (:func:`refuse`)."""


@runtime_checkable
class GroupPlanner(Protocol):
    """A planner that takes a run of samples at once (``add_group``: the same micro-batches as :func:`add_each`)."""

    def add_group(self, samples: Sequence[TrainingSequence]) -> GroupAdded: ...


def group_adder(planner: Adds) -> Callable[[Sequence[TrainingSequence]], GroupAdded]:
    """``add_group(samples)`` for ``planner``: ``add`` on each of ``samples`` in order until one closes a
    micro-batch (:class:`GroupAdded`), through the planner's own ``add_group`` when it has one
    (:class:`GroupPlanner`), else :func:`add_each`. The trainer hands the planner a group's samples as the rollout
    queue delivers them, one call instead of one a sample. Resolve it once: a protocol check costs ~5 us."""
    if isinstance(planner, GroupPlanner):
        return planner.add_group
    return functools.partial(add_each, planner)


def add_each(planner: Adds, samples: Sequence[TrainingSequence]) -> GroupAdded:
    """:func:`add_group` by one ``add`` call a sample: what every ``add_group`` must equal."""
    dropped = []
    for i, sample in enumerate(samples):
        before = planner.dropped_oversize_count
        batch = planner.add(sample)
        if planner.dropped_oversize_count > before:
            dropped.append(i)
        if batch is not None:
            return GroupAdded(batch, i + 1, dropped)
    return GroupAdded(None, len(samples), dropped)


class TokenBudgetPlanner:
    """Greedy Σ L²-balancing bin packer over ``num_ranks`` rows of at most ``token_budget`` tokens each."""

    def __init__(self, token_budget: int, num_ranks: int) -> None:
        if token_budget <= 0:
            raise ValueError(f"packing.token_budget must be positive, got {token_budget}")
        if num_ranks <= 0:
            raise ValueError(f"num_ranks must be positive, got {num_ranks}")
        self.token_budget = token_budget
        self.num_ranks = num_ranks
        self.dropped_oversize_count = 0
        self._reset()

    def _reset(self) -> None:
        self._rows: list[list[TrainingSequence]] = [[] for _ in range(self.num_ranks)]
        self._tokens = [0] * self.num_ranks
        self._cost = [0] * self.num_ranks

    @property
    def num_open_samples(self) -> int:
        return sum(len(r) for r in self._rows)

    def add(self, sample: TrainingSequence) -> MicroBatch | None:
        """Place ``sample``; return the micro-batch it closed, if any (then the sample opens the next one)."""
        length = int(sample.input_ids.shape[0])
        if not 0 < length <= self.token_budget:
            return refuse(self, length)
        emitted = None
        tokens, cost, limit = self._tokens, self._cost, self.token_budget - length
        rank = -1
        for r in range(self.num_ranks):  # the fitting row of least cost, ties: lowest rank
            if tokens[r] <= limit and (rank < 0 or cost[r] < cost[rank]):
                rank = r
        if rank < 0:
            emitted = self._emit(self._rows)
            tokens, cost, rank = self._tokens, self._cost, 0
        self._rows[rank].append(sample)
        tokens[rank] += length
        cost[rank] += length * length
        return emitted

    def flush(self, allow_filler: bool = True) -> MicroBatch | None:
        """Emit the open rows (end of data). None when nothing is open.

        With at least ``num_ranks`` open samples every row is already non-empty (see the module docstring). With
        fewer (but some), two choices, decided by the caller:
          - ``allow_filler=False``: return None and keep the samples open, so the caller can wait for more;
          - ``allow_filler=True`` (default): each empty rank gets a context-only copy of the shortest open sample
            (:func:`context_only`: same tokens, nothing trained, advantage 0). It runs a forward and backward that
            contribute zero gradient, keeping the ranks' collectives in step. Its ranks are listed in
            ``MicroBatch.filler_ranks`` and its tokens are counted as forwarded, never as trained.
        """
        if self.num_open_samples == 0:
            return None
        empty = [r for r, row in enumerate(self._rows) if not row]
        if empty and not allow_filler:
            return None
        return self._emit(self._rows)

    def _emit(self, rows: list[list[TrainingSequence]]) -> MicroBatch:
        batch = micro_batch(rows, self.token_budget)
        self._reset()
        return batch


def micro_batch(rows: list[list[TrainingSequence]], token_budget: int) -> MicroBatch:
    """The ``MicroBatch`` of ``rows`` (one per rank); an empty rank gets a context-only copy of the shortest sample
    (:func:`context_only`), listed in ``filler_ranks``."""
    empty = tuple(r for r, row in enumerate(rows) if not row)
    if empty:
        shortest = min((s for row in rows for s in row), key=len)
        rows = [row if row else [context_only(shortest)] for row in rows]
    lengths = [
        np.fromiter((s.input_ids.shape[0] for s in row), dtype=np.int64, count=len(row)) for row in rows
    ]
    return MicroBatch(
        rows=rows,
        samples_per_row=np.array([len(row) for row in rows], dtype=np.int64),
        tokens_per_row=np.array([ls.sum() for ls in lengths], dtype=np.int64),
        trained_per_row=np.array([num_trained(row) for row in rows], dtype=np.int64),
        attn_cost_per_row=np.array([(ls * ls).sum() for ls in lengths], dtype=np.int64),
        token_budget=token_budget,
        filler_ranks=empty,
    )


def num_trained(row: list[TrainingSequence]) -> int:
    """Σ ``num_trained`` over ``row`` (one count over the row's concatenated masks when they are boolean)."""
    masks = [s.train_mask for s in row]
    if all(m.dtype == np.bool_ for m in masks):
        return int(np.count_nonzero(np.concatenate(masks)))
    return sum(s.num_trained for s in row)


class FixedCountPlanner:
    """``packing.token_budget <= 0``: no token budget; every micro-batch takes ``samples_per_row * num_ranks``
    samples, spread over the rows to balance Σ L² (longest first, each into the row with the smallest cost so far).

    ``token_budget`` is the allowance's size per row (``samples_per_row * max_len``, the most a row can hold);
    nothing is ever dropped as oversize.
    """

    def __init__(self, samples_per_row: int, num_ranks: int, max_len: int) -> None:
        if samples_per_row < 1 or num_ranks < 1 or max_len < 1:
            raise ValueError(
                f"samples_per_row ({samples_per_row}), num_ranks ({num_ranks}) and max_len ({max_len}) must be >= 1"
            )
        self.samples_per_row, self.num_ranks = samples_per_row, num_ranks
        self.token_budget = samples_per_row * max_len
        self.dropped_oversize_count = 0
        self._open: list[TrainingSequence] = []

    @property
    def num_open_samples(self) -> int:
        return len(self._open)

    def add(self, sample: TrainingSequence) -> MicroBatch | None:
        if len(sample) == 0:
            raise ValueError("empty sample (no tokens) given to the planner")
        self._open.append(sample)
        if len(self._open) < self.samples_per_row * self.num_ranks:
            return None
        return self._emit()

    def flush(self, allow_filler: bool = True) -> MicroBatch | None:
        """Emit what is open (end of data); fewer samples than ranks get context-only fillers, as
        ``TokenBudgetPlanner.flush`` explains (``allow_filler=False``: keep them open instead)."""
        if not self._open or (len(self._open) < self.num_ranks and not allow_filler):
            return None
        return self._emit()

    def _emit(self) -> MicroBatch:
        rows: list[list[TrainingSequence]] = [[] for _ in range(self.num_ranks)]
        ordered = sorted(self._open, key=len, reverse=True)  # stable: equal lengths keep arrival order
        if self.num_ranks == 1:
            rows[0] = ordered
        else:
            heap = [(0, r) for r in range(self.num_ranks)]  # (cost, rank): pops the argmin, ties lowest rank
            for sample in ordered:
                cost, rank = heap[0]
                rows[rank].append(sample)
                n = len(sample)
                heapq.heapreplace(heap, (cost + n * n, rank))
        self._open = []
        return micro_batch(rows, self.token_budget)
