"""Streaming token-budget planner for tree-packed rows: samples in, micro-batches (one row per rank) out.

Same interface as :class:`~asyncgrpo_cli.packing.planner.TokenBudgetPlanner` (``add`` / ``flush`` /
``MicroBatch`` / ``dropped_oversize_count`` / ``num_open_samples``); what differs is the cost of a row. Each open
row keeps the tries (``packing/trie.py``) its :class:`~asyncgrpo_cli.packing.tree.TreePacker` row will be laid
out from: one for the whole row (``share_across_groups``, this class: groups share the prefixes their prompts
have in common) or one per group (:class:`GroupTreeBudgetPlanner`, for ``packing.share_across_groups=false``).
So a row's costs are exactly what its packed row will be:

  - forwarded tokens = unique placements (a shared prefix counts once; a forked node once per branch);
  - attention cost   = attention pairs, Σ over forwarded tokens of (depth + 1);
  - trained tokens   = Σ trained tokens of its samples (loss terms are never deduplicated).

``MicroBatch.tokens_per_row`` therefore holds forwarded (unique) tokens and ``attn_cost_per_row`` attention
pairs (not Σ L²), so ``row_fill_frac`` and ``row_imbalance`` describe the rows as packed.

Each emitted row is a :class:`~asyncgrpo_cli.packing.trie.PlannedRow`: the list of its samples plus the
placements its tries gave them, which the packer lays the row out from instead of computing them again.

``token_budget`` bounds both forwarded and trained tokens of every row (bounding only forwarded tokens would
let a row of identical samples grow without end). What a sample adds to a row (``new``: forwarded tokens,
``after``: the row's attention cost with it) is read off a probe of the row's trie, so a row that already holds
a prefix of the sample, from its own group or another, is charged only the rest. Placement of a sample
(reference section i.3):

  1. a row that already holds the sample's group and still fits it: the one it adds fewest tokens to
     (ties: lowest ``after``, then lowest rank);
  2. otherwise, for a sample whose group is open somewhere: an empty row if any; else the fitting row of lowest
     ``after`` among those whose ``after`` stays at most the largest row cost (it does not slow the
     micro-batch down); otherwise the micro-batch is emitted and the sample starts the next one;
  3. a sample of a new group: the fitting row of lowest ``after`` (ties: lowest rank); when none fits, the
     micro-batch is emitted.

Rules 2-3 are where groups meet: a new group goes to the row that ends up cheapest *with* it, so a row whose
groups share its prefix wins unless it is already more loaded by more than the prefix saves (a 1k-token system
prompt costs its pairs once per row, not once per group, while rows stay balanced). Without cross-group sharing
(or with one trie per group) ``after`` is the row's cost plus the sample's own pairs in every row, and the rules
are the per-group rules they were (lowest cost, then lowest rank).

Every emitted micro-batch has a non-empty row on every rank: an admissible sample (length <= budget) fits an
empty row, and rules 2-3 use an empty row before emitting. A sample longer than ``token_budget`` is dropped and
counted in ``dropped_oversize_count``.

How it runs: the rules are a compiled kernel (``packing/tree_rules.py``) over the tries' arrays, and a compiled
call costs about as much as deciding a sample in Python, so ``add`` defers the samples that cannot close the
micro-batch, whatever the rules do with the samples deferred before them, and places them later, in arrival
order, in one call. A row's *room* is ``budget`` minus its forwarded or trained tokens, whichever is larger. Each deferred
sample claims, from the rows it may go to, the most it can add to one (its length, and trained tokens, at most
its length; a sample that starts with its group's first sample's untrained prefix of P tokens adds at most
L - P + 1 tokens to the row holding that sample). A sample may be deferred when its claim fits the unclaimed
room of:

  - one of its group's rows, for a group placed earlier (rule 1 then takes it into one of them; it claims from
    each of them);
  - every row, for a group whose first sample is deferred too (the one row that will hold the group may be any;
    it claims from every row);
  - some row, for a new group (rule 3 takes it into one that fits; it claims from every row).

The first sample that may not be deferred places them all; only it can close the micro-batch, which ``add`` then
returns as before. The micro-batches are the ones deciding every sample on arrival gives, at the same ``add``
calls (``tests/test_tree_planner.py``), at ~3 us a sample instead of ~6-11 (``asyncgrpo bench planning``).

The trainer hands over a group's samples at once (``add_group``, as the rollout queue delivers them): they join
the waiting samples and all are placed in one call, no deferral check needed; the first sample no row takes
closes the micro-batch and opens the next, and the samples after it are given back (the caller feeds them again
when it wants them). That saves each sample's deferral check (its claims, a prompt comparison when rows are
tight), and with rows of a few thousand tokens, where ``add`` places every ~17 samples anyway, most of the
planning's Python.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from operator import attrgetter

import numpy as np

from asyncgrpo_cli.packing.planner import GroupAdded, MicroBatch, add_each, context_only, refuse
from asyncgrpo_cli.packing.tree_rules import COST, TOKENS, TRAINED, place
from asyncgrpo_cli.packing.trie import SAMPLES, Forest, PlannedRow, group_key
from asyncgrpo_cli.samples import TrainingSequence

_INT64, _BOOL = np.dtype(np.int64), np.dtype(np.bool_)
_IDS, _MASK = attrgetter("input_ids"), attrgetter("train_mask")
_GROUP_KEY = attrgetter("group_id", "prompt_seq")  # group_key(sample)
_NO_FLAGS, _NO_ENDS = np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.int64)  # masks not boolean: _place


def _int64_ids(ids: list[np.ndarray]) -> np.ndarray:
    """The samples' ids one after another, as int64 (each converted as ``add`` converts it when one is not)."""
    cat = np.concatenate(ids)
    return cat if cat.dtype == _INT64 else np.concatenate([np.asarray(a, dtype=np.int64) for a in ids])


class TreeBudgetPlanner:
    """Group-affine bin packer over ``num_ranks`` rows bounded by ``token_budget`` unique and trained tokens."""

    share_across_groups = True
    """One trie per row (groups share common prefixes); :class:`GroupTreeBudgetPlanner`: one per group."""

    min_group_run = 12
    """Shorter runs go through ``add`` a sample: a compiled call costs ~20 us, and ``add``'s deferral places ~17
    samples a call with 8 rows of 8k tokens and ~77 with one row of 64k, so a run of a few samples (GRPO with a
    small group, distillation's one sample a prompt) plans faster by deferral (``bench planning feed=both``: one
    sample a group 21 against 7 us/sample at 8 ranks; 4 a group 6.7 against 3.4 with one row; 16 a group faster
    by group either way)."""

    def __init__(self, token_budget: int, num_ranks: int) -> None:
        if token_budget <= 0:
            raise ValueError(f"packing.token_budget must be positive, got {token_budget}")
        if num_ranks <= 0:
            raise ValueError(f"num_ranks must be positive, got {num_ranks}")
        self.token_budget = token_budget
        self.num_ranks = num_ranks
        self.dropped_oversize_count = 0
        self._forest = Forest(num_ranks)
        self._totals = np.zeros((num_ranks, 3), dtype=np.int64)  # per row: TOKENS, TRAINED, COST
        self._homes = np.full((64, num_ranks), -1, dtype=np.int64)  # per group number and row: its trie root
        self._rooms = np.zeros(num_ranks, dtype=np.int64)  # per row: its room after the last placement
        self._groups: dict[Hashable, int] = {}  # this micro-batch's groups, numbered as they come
        # the waiting samples, with their ids, masks, group numbers and lengths
        self._waiting: list[TrainingSequence] = []
        self._waiting_ids: list[np.ndarray] = []
        self._waiting_masks: list[np.ndarray] = []
        self._waiting_group: list[int] = []
        self._waiting_len: list[int] = []  # their lengths
        self._uneven = False  # whether a waiting sample's mask is not as long as its ids
        self._waiting_new: set[int] = set()  # groups first seen among the waiting samples
        self._reset()

    def _reset(self) -> None:
        """An empty micro-batch."""
        self._rows: list[list[TrainingSequence]] = [[] for _ in range(self.num_ranks)]
        self._forest.clear()
        self._totals[:] = 0
        self._homes[: len(self._groups)] = -1
        self._groups.clear()
        self._first: list[TrainingSequence] = []  # per group number: its first sample in this micro-batch
        self._prefixes: dict[int, tuple[int, bytes]] = {}  # per group number: _prefix_bound
        # per row: its room less the claims of waiting samples that may go to it alone (rows holding their group)
        self._slack = [self.token_budget] * self.num_ranks
        self._claimed = 0  # claims of waiting samples that may go to any row
        self._home_rows: dict[int, list[int]] = {}  # per group number: its rows (since the last placement)
        self._placed_groups = 0  # groups numbered at the last placement
        self._placed = self._stored = 0  # samples placed and tokens stored (at most) in the open micro-batch

    @property
    def num_open_samples(self) -> int:
        return sum(len(r) for r in self._rows) + len(self._waiting)

    def add(self, sample: TrainingSequence) -> MicroBatch | None:
        """Place ``sample``; return the micro-batch it closed, if any (then the sample opens the next one)."""
        ids = sample.input_ids
        if ids.dtype != _INT64:
            ids = np.asarray(ids, dtype=np.int64)
        length = ids.shape[0]
        if not 0 < length <= self.token_budget:
            return refuse(self, length)
        g = self._group_number(_GROUP_KEY(sample), sample)
        self._waiting.append(sample)
        self._waiting_ids.append(ids)
        self._waiting_group.append(g)
        self._waiting_len.append(length)
        mask = sample.train_mask
        self._waiting_masks.append(mask)
        mask_len = mask.shape[0]  # its tokens and trained tokens are at most the larger length
        if mask_len != length:
            self._uneven = True
        if self._may_wait(sample, ids, length, length if length >= mask_len else mask_len, g):
            return None
        return self._place_waiting(len(self._waiting) - 1)[0]

    def add_group(self, samples: Sequence[TrainingSequence]) -> GroupAdded:
        """``add`` on each of ``samples`` until one closes a micro-batch (:func:`~asyncgrpo_cli.packing.planner.
        add_group`), in one compiled placement: the samples join the waiting ones and all are placed in arrival
        order, which decides each as on arrival, so the micro-batches are those of the ``add`` calls. The first
        sample no row takes closes the micro-batch and opens the next; those after it are not taken. A run shorter
        than ``min_group_run``, or with a sample that is empty or longer than the budget, goes through ``add`` a
        sample."""
        if len(samples) < self.min_group_run:
            return add_each(self, samples)
        ids = list(map(_IDS, samples))
        lengths = list(map(len, ids))
        if min(lengths) <= 0 or max(lengths) > self.token_budget:
            return add_each(self, samples)
        first = len(self._waiting)
        masks = list(map(_MASK, samples))
        if not self._uneven and list(map(len, masks)) != lengths:
            self._uneven = True
        keys = list(map(_GROUP_KEY, samples))  # group_key, inline
        if keys.count(keys[0]) == len(keys):  # one group, as the rollout queue delivers them
            self._waiting_group.extend([self._group_number(keys[0], samples[0])] * len(keys))
        else:
            self._waiting_group.extend([self._group_number(k, s) for k, s in zip(keys, samples)])
        self._waiting.extend(samples)
        self._waiting_ids.extend(ids)
        self._waiting_masks.extend(masks)
        self._waiting_len.extend(lengths)
        batch, closed = self._place_waiting(first)
        return GroupAdded(batch, closed - first + 1 if batch is not None else len(samples))

    def _group_number(self, key: Hashable, sample: TrainingSequence) -> int:
        """The open micro-batch's number for group ``key``, numbering it (``sample``: its first) when new."""
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = len(self._groups)
            self._first.append(sample)
        return g

    def _may_wait(self, sample: TrainingSequence, ids: np.ndarray, length: int, bound: int, g: int) -> bool:
        """Whether ``sample`` (just queued, of group number ``g``, adding at most ``bound`` tokens or trained tokens
        to a row) cannot close the micro-batch whatever the rules do with the samples waiting before it, claiming
        from the rows it may go to the most it can add to one. Row r's unclaimed room is ``slack[r] - claimed``:
        its room less what the waiting samples that may go to it alone, or to any row, can add (module
        docstring)."""
        slack = self._slack
        rows = self._home_rows.get(g)
        if rows is None and g < self._placed_groups:
            rows = self._home_rows[g] = np.flatnonzero(self._homes[g] >= 0).tolist()
        if rows:  # a group placed earlier: rule 1 takes it into one of its rows if one fits it
            best = (slack[rows[0]] if len(rows) == 1 else max([slack[r] for r in rows])) - self._claimed
            if best < bound and len(rows) == 1:
                bound = self._prefix_bound(sample, ids, length, g, bound)
            if best < bound:
                return False
            for r in rows:
                slack[r] -= bound
            return True
        if g in self._waiting_new:  # its group's first sample waits too and goes first: the one row that will
            least = min(slack) - self._claimed  # hold the group (rule 1 keeps it there) may be any row
            if least < bound:
                bound = self._prefix_bound(sample, ids, length, g, bound)
            if least < bound:
                return False
        else:  # a new group: rule 3 takes it into any row that fits it
            self._waiting_new.add(g)
            if max(slack) - self._claimed < bound:
                return False
        self._claimed += bound
        return True

    def _prefix_bound(
        self, sample: TrainingSequence, ids: np.ndarray, length: int, g: int, bound: int
    ) -> int:
        """A tighter ``bound`` for a sample of a group that one row will hold when its turn comes (the group's
        first sample with it): when the sample starts with that first sample's untrained prefix (P tokens: a GRPO
        group's prompt), it adds at most L - P + 1 tokens to the row (it shares P tokens there; a fork duplicates
        one), and its trained tokens, counted."""
        known = self._prefixes.get(g)
        if known is None:
            first = self._first[g]
            head = np.flatnonzero(first.train_mask)
            p = int(head[0]) if head.size else len(first)
            known = self._prefixes[g] = (p, np.asarray(first.input_ids[:p], dtype=np.int64).tobytes())
        p, prefix = known
        if p == 0 or length <= p or ids[:p].tobytes() != prefix:
            return bound
        mask = sample.train_mask
        trained = int(np.count_nonzero(mask)) if mask.dtype == _BOOL else sample.num_trained
        return min(bound, max(length - p + 1, trained))

    def _place_waiting(self, may_close: int) -> tuple[MicroBatch | None, int]:
        """Place the waiting samples (module docstring), of which those from ``may_close`` on may close the
        micro-batch (the ones before were deferred because they cannot). Returns the micro-batch the first that no
        row takes closed and that sample's index (it opens the next micro-batch; the samples after it are not
        taken), or (None, the number waiting)."""
        n = len(self._waiting)
        closed = self._place(0)
        emitted = None
        if closed < n:
            if closed < may_close:
                raise RuntimeError(
                    f"tree planner: sample {closed} of {n} waiting closed the micro-batch; only those from "
                    f"{may_close} on can (each sample deferred fit a row it may go to)"
                )
            waiting = (
                self._waiting,
                self._waiting_ids,
                self._waiting_masks,
                self._waiting_group,
                self._waiting_len,
            )
            for column in waiting:  # the samples after the closing one are not taken
                del column[closed + 1 :]
            key = group_key(self._waiting[closed])
            emitted = self._emit()
            self._groups[key] = self._waiting_group[closed] = 0  # the first group of the next micro-batch
            self._first.append(self._waiting[closed])
            if self._place(closed) != closed + 1:
                raise RuntimeError("tree planner: a sample did not fit an empty micro-batch")
        self._waiting, self._waiting_ids, self._waiting_group, self._waiting_len = [], [], [], []
        self._waiting_masks = []
        self._uneven = False
        self._waiting_new.clear()
        return emitted, closed

    def _place(self, start: int) -> int:
        """Run :func:`_place` over the waiting samples from ``start``; add the placed ones to their rows; returns
        the index it stopped at."""
        n, groups = len(self._waiting), len(self._groups)
        if groups > self._homes.shape[0]:
            homes = np.full((2 * groups, self.num_ranks), -1, dtype=np.int64)
            homes[: self._homes.shape[0]] = self._homes
            self._homes = homes
        forest, k = self._forest, n - start
        lengths = self._waiting_len[start:]
        self._placed += k
        # a row's trie stores at most its forwarded tokens
        self._stored = min(self._stored + sum(lengths), self.token_budget)
        forest.reserve(self._placed, self._stored)
        masks = self._waiting_masks[start:]
        trained = np.empty(k, dtype=np.int64)
        flags = np.concatenate(masks)  # boolean only when every mask is: other dtypes promote away from bool
        if flags.dtype == _BOOL and flags.ndim == 1:
            flags = flags.view(np.uint8)  # their trained tokens are counted by the kernel
            # each mask ends where its ids do (no ends given), unless one is of another length (then the packer
            # refuses its row)
            flag_ends = np.cumsum(np.fromiter(map(len, masks), _INT64, count=k)) if self._uneven else _NO_ENDS
        else:
            trained[:] = [s.num_trained for s in self._waiting[start:]]
            flags, flag_ends = _NO_FLAGS, _NO_ENDS
        assign = np.empty(k, dtype=np.int64)
        stop = start + place(
            forest.nodes, forest.store, forest.meta, forest.counts, forest.walk, self._totals, self._homes,
            _int64_ids(self._waiting_ids[start:]), np.array(lengths, dtype=np.int64), trained, flags, flag_ends,
            np.array(self._waiting_group[start:], dtype=np.int64), 0, self.token_budget, self.share_across_groups,
            assign, self._rooms,
        )  # fmt: skip
        self._slack, self._claimed = self._rooms.tolist(), 0
        self._home_rows = {}
        self._placed_groups = groups
        rows, placed, ranks = self._rows, self._waiting[start:stop], assign[: stop - start].tolist()
        if ranks and ranks.count(ranks[0]) == len(ranks):  # one row (a group keeps to its row)
            rows[ranks[0]].extend(placed)
        else:
            for sample, rank in zip(placed, ranks):
                rows[rank].append(sample)
        self._placed -= n - stop
        return stop

    def flush(self, allow_filler: bool = True) -> MicroBatch | None:
        """Emit the open rows (end of data). None when nothing is open.

        Empty ranks (fewer open samples than ranks) are handled as in ``TokenBudgetPlanner.flush``: with
        ``allow_filler=False`` return None and keep the samples open; otherwise each empty rank gets a
        context-only copy of the shortest open sample, listed in ``MicroBatch.filler_ranks``.
        """
        if self._waiting and self._place_waiting(len(self._waiting))[0] is not None:
            raise RuntimeError("tree planner: a waiting sample closed the micro-batch at flush")
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
                self._totals[r] = (n, 0, n * (n + 1) // 2)
        return self._emit(filler_ranks=tuple(empty))

    def _emit(self, filler_ranks: tuple[int, ...] = ()) -> MicroBatch:
        totals = self._totals
        batch = MicroBatch(
            rows=[self._planned(r, row) for r, row in enumerate(self._rows)],
            samples_per_row=np.array([len(row) for row in self._rows], dtype=np.int64),
            tokens_per_row=totals[:, TOKENS].copy(),
            trained_per_row=totals[:, TRAINED].copy(),
            attn_cost_per_row=totals[:, COST].copy(),
            token_budget=self.token_budget,
            filler_ranks=filler_ranks,
        )
        self._reset()
        return batch

    def _planned(self, rank: int, row: list[TrainingSequence]) -> list[TrainingSequence]:
        """``row`` as a :class:`PlannedRow` carrying its tries' placements in row order (the packer's layout then
        skips computing them); a filler row (no trie) stays a plain list. The row's tries number its samples in
        row order, whether it has one trie or one per group, so a parent is a row index."""
        if self._forest.counts[rank, SAMPLES] == 0:
            return row
        parents, own_from, lengths = self._forest.placements(rank)
        return PlannedRow(row, parents, own_from, lengths, self.share_across_groups)


class GroupTreeBudgetPlanner(TreeBudgetPlanner):
    """:class:`TreeBudgetPlanner` over one trie per group (``packing.share_across_groups=false``): groups never
    share tokens, as the :class:`~asyncgrpo_cli.packing.tree.TreePacker` lays them out then."""

    share_across_groups = False
