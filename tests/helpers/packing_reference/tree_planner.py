"""Streaming token-budget planner for tree-packed rows: samples in, micro-batches (one row per rank) out.

Same interface as :class:`~asyncgrpo_cli.packing.planner.TokenBudgetPlanner` (``add`` / ``flush`` /
``MicroBatch`` / ``dropped_oversize_count`` / ``num_open_samples``); what differs is the cost of a row. Each open
row keeps one :class:`~asyncgrpo_cli.packing.trie.GroupTrie` per group, the same tries the
:class:`~asyncgrpo_cli.packing.tree.TreePacker` builds, so a row's costs are exactly what its packed row will be:

  - forwarded tokens = unique placements (a shared prefix counts once; a forked node once per branch);
  - attention cost   = attention pairs, Σ over forwarded tokens of (depth + 1);
  - trained tokens   = Σ trained tokens of its samples (loss terms are never deduplicated).

``MicroBatch.tokens_per_row`` therefore holds forwarded (unique) tokens and ``attn_cost_per_row`` attention
pairs (not Σ L²), so ``row_fill_frac`` and ``row_imbalance`` describe the rows as packed.

``token_budget`` bounds both forwarded and trained tokens of every row (bounding only forwarded tokens would
let a row of identical samples grow without end). Placement of a sample (reference section i.3):

  1. a row that already holds the sample's group and still fits it: the one it adds fewest tokens to
     (ties: lowest attention cost, then lowest rank);
  2. otherwise, for a sample whose group is open somewhere: an empty row if any; else a fitting row whose
     cost after adding it stays at most the largest row cost (it does not slow the micro-batch down);
     otherwise the micro-batch is emitted and the sample starts the next one;
  3. a sample of a new group: the fitting row with the lowest attention cost (ties: lowest rank); when none
     fits, the micro-batch is emitted.

Every emitted micro-batch has a non-empty row on every rank: an admissible sample (length <= budget) fits an
empty row, and rules 2-3 use an empty row before emitting. A sample longer than ``token_budget`` is dropped and
counted in ``dropped_oversize_count``. The work per sample is one trie probe per row holding its group (a numpy
comparison against that group's samples) plus numpy operations over ``num_ranks`` entries.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import numpy as np

from asyncgrpo_cli.samples import TrainingSequence
from tests.helpers.packing_reference.planner import MicroBatch, context_only
from tests.helpers.packing_reference.trie import Attachment, GroupTrie, group_key

logger = logging.getLogger(__name__)


class TreeBudgetPlanner:
    """Group-affine bin packer over ``num_ranks`` rows bounded by ``token_budget`` unique and trained tokens."""

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
        self._tries: list[dict[Hashable, GroupTrie]] = [{} for _ in range(self.num_ranks)]
        self._tokens = np.zeros(self.num_ranks, dtype=np.int64)
        self._trained = np.zeros(self.num_ranks, dtype=np.int64)
        self._cost = np.zeros(self.num_ranks, dtype=np.int64)

    @property
    def num_open_samples(self) -> int:
        return sum(len(r) for r in self._rows)

    def add(self, sample: TrainingSequence) -> MicroBatch | None:
        """Place ``sample``; return the micro-batch it closed, if any (then the sample opens the next one)."""
        ids = np.asarray(sample.input_ids, dtype=np.int64)
        length = int(ids.shape[0])
        if length == 0:
            raise ValueError("empty sample (no tokens) given to the planner")
        if length > self.token_budget:
            self.dropped_oversize_count += 1
            logger.warning(
                "dropping a sample of %d tokens: longer than packing.token_budget (%d); raise "
                "packing.token_budget or lower sampling.max_completion_length",
                length,
                self.token_budget,
            )
            return None
        key = group_key(sample)
        home = np.array([r for r in range(self.num_ranks) if key in self._tries[r]], dtype=np.int64)
        attachments: dict[int, Attachment] = {r: self._tries[r][key].probe(ids) for r in home.tolist()}
        new_tokens = np.full(self.num_ranks, length, dtype=np.int64)
        new_pairs = np.full(self.num_ranks, length * (length + 1) // 2, dtype=np.int64)
        for r, att in attachments.items():
            new_tokens[r], new_pairs[r] = att.new_tokens, att.new_pairs
        trained = sample.num_trained
        fits = (self._tokens + new_tokens <= self.token_budget) & (
            self._trained + trained <= self.token_budget
        )
        rank = self._choose(fits, home, new_tokens, new_pairs)
        emitted = None
        if rank is None:
            emitted = self._emit(self._rows)
            rank, attachments = 0, {}
            new_tokens[:], new_pairs[:] = length, length * (length + 1) // 2
        tries = self._tries[rank]
        trie = tries[key] if key in tries else tries.setdefault(key, GroupTrie())
        trie.insert(ids, attachments.get(rank))
        self._rows[rank].append(sample)
        self._tokens[rank] += new_tokens[rank]
        self._trained[rank] += trained
        self._cost[rank] += new_pairs[rank]
        return emitted

    def _choose(
        self, fits: np.ndarray, home: np.ndarray, new_tokens: np.ndarray, new_pairs: np.ndarray
    ) -> int | None:
        """The rank for a sample under rules 1-3 of the module docstring; None: emit the micro-batch first."""
        big = np.iinfo(np.int64).max
        if home.size:
            ok = home[fits[home]]
            if ok.size:
                order = np.lexsort((ok, self._cost[ok] + new_pairs[ok], new_tokens[ok]))
                return int(ok[order[0]])
            empty = np.flatnonzero(np.array([not row for row in self._rows]))
            if empty.size:
                return int(empty[0])
            elsewhere = fits & (self._cost + new_pairs <= self._cost.max())
            elsewhere[home] = False
            if not elsewhere.any():
                return None
            return int(np.argmin(np.where(elsewhere, self._cost, big)))
        if not fits.any():
            return None
        return int(np.argmin(np.where(fits, self._cost, big)))

    def flush(self, allow_filler: bool = True) -> MicroBatch | None:
        """Emit the open rows (end of data). None when nothing is open.

        Empty ranks (fewer open samples than ranks) are handled as in ``TokenBudgetPlanner.flush``: with
        ``allow_filler=False`` return None and keep the samples open; otherwise each empty rank gets a
        context-only copy of the shortest open sample, listed in ``MicroBatch.filler_ranks``.
        """
        if self.num_open_samples == 0:
            return None
        empty = [r for r, row in enumerate(self._rows) if not row]
        if empty and not allow_filler:
            return None
        if empty:
            filler = context_only(min((s for row in self._rows for s in row), key=len))
            n = len(filler)
            for r in empty:
                self._rows[r] = [filler]
                self._tokens[r], self._trained[r], self._cost[r] = n, 0, n * (n + 1) // 2
        return self._emit(self._rows, filler_ranks=tuple(empty))

    def _emit(self, rows: list[list[TrainingSequence]], filler_ranks: tuple[int, ...] = ()) -> MicroBatch:
        batch = MicroBatch(
            rows=rows,
            samples_per_row=np.array([len(row) for row in rows], dtype=np.int64),
            tokens_per_row=self._tokens.copy(),
            trained_per_row=self._trained.copy(),
            attn_cost_per_row=self._cost.copy(),
            token_budget=self.token_budget,
            filler_ranks=filler_ranks,
        )
        self._reset()
        return batch
