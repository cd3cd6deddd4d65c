"""Streaming token-budget planner for tree-packed rows: samples in, micro-batches (one row per rank) out.

Same interface as :class:`~asyncgrpo_cli.packing.planner.TokenBudgetPlanner` (``add`` / ``flush`` /
``MicroBatch`` / ``dropped_oversize_count`` / ``num_open_samples``); what differs is the cost of a row. Each open
row keeps the :class:`~asyncgrpo_cli.packing.trie.GroupTrie` its :class:`~asyncgrpo_cli.packing.tree.TreePacker`
row will be laid out from: one for the whole row (``share_across_groups``, this class: groups share the prefixes
their prompts have in common) or one per group (:class:`GroupTreeBudgetPlanner`, for
``packing.share_across_groups=false``). So a row's costs are exactly what its packed row will be:

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
counted in ``dropped_oversize_count``. The work per sample is one trie probe per row holding its group (a walk
down the radix trie, ``packing/trie.py``; rules 2-3 probe every open row once) plus scans of ``num_ranks`` Python
integers; no numpy call runs per sample beyond counting its trained tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import numpy as np

from asyncgrpo_cli.packing.planner import MicroBatch, context_only
from asyncgrpo_cli.packing.trie import Attachment, GroupTrie, PlannedRow, group_key
from asyncgrpo_cli.samples import TrainingSequence

logger = logging.getLogger(__name__)
_INT64, _BOOL = np.dtype(np.int64), np.dtype(np.bool_)


class TreeBudgetPlanner:
    """Group-affine bin packer over ``num_ranks`` rows bounded by ``token_budget`` unique and trained tokens."""

    share_across_groups = True
    """One trie per row (groups share common prefixes); :class:`GroupTreeBudgetPlanner`: one per group."""

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
        self._homes: dict[Hashable, list[int]] = {}  # group -> the ranks holding it, ascending
        self._tokens = [0] * self.num_ranks
        self._trained = [0] * self.num_ranks
        self._cost = [0] * self.num_ranks

    @property
    def num_open_samples(self) -> int:
        return sum(len(r) for r in self._rows)

    def add(self, sample: TrainingSequence) -> MicroBatch | None:
        """Place ``sample``; return the micro-batch it closed, if any (then the sample opens the next one)."""
        ids = sample.input_ids
        if ids.dtype is not _INT64:
            ids = np.asarray(ids, dtype=np.int64)
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
        group = group_key(sample)
        tkey = None if self.share_across_groups else group  # the trie of a row the sample goes into
        key = ids.tobytes()
        mask = sample.train_mask
        trained = int(np.count_nonzero(mask)) if mask.dtype is _BOOL else sample.num_trained
        home = self._homes.get(group)
        emitted = None
        if home is None:
            rank = self._choose_new(length, trained, self._probe_others(ids, key, tkey, ()))
        elif len(home) == 1:  # the usual case: rule 1 has one candidate
            r = home[0]
            att = self._tries[r][tkey].probe(ids, key)
            if self._tokens[r] + length - att.own_from <= self.token_budget and (
                self._trained[r] + trained <= self.token_budget
            ):
                rank = r
            else:
                rank = self._choose_home(length, trained, {r: att}, ids, key, tkey)
        else:
            tries = self._tries
            attachments = {r: tries[r][tkey].probe(ids, key) for r in home}
            rank = self._choose_home(length, trained, attachments, ids, key, tkey)
        if rank is None:
            emitted = self._emit(self._rows)
            rank = 0
        tries = self._tries[rank]
        trie = tries.get(tkey)
        if trie is None:  # an empty row (or, per group, the group's first sample in it): probe a new trie
            trie = tries[tkey] = GroupTrie()
            trie.probe(ids, key)
        ranks = self._homes.setdefault(group, [])
        if rank not in ranks:
            ranks.append(rank)
            ranks.sort()
        own = trie.commit().own_from  # the trie's last probe is this sample's (in this row's rules)
        self._rows[rank].append(sample)
        self._tokens[rank] += length - own
        self._trained[rank] += trained
        self._cost[rank] += (length * (length + 1) - own * (own + 1)) // 2
        return emitted

    def _probe_others(
        self, ids: np.ndarray, key: bytes, tkey: Hashable, home: list[int] | tuple[()]
    ) -> dict[int, Attachment | None]:
        """Rank -> the sample's probe of that row's trie, for every rank outside ``home``; None where the row has
        no trie the sample would join (an empty row, or with one trie per group, a row without its group): it
        places all of its tokens there."""
        out: dict[int, Attachment | None] = {}
        for r, tries in enumerate(self._tries):
            if r in home:
                continue
            trie = tries.get(tkey)
            out[r] = None if trie is None else trie.probe(ids, key)
        return out

    def _choose_home(
        self,
        length: int,
        trained: int,
        attachments: dict[int, Attachment],
        ids: np.ndarray,
        key: bytes,
        tkey: Hashable,
    ) -> int | None:
        """Rules 1-2 for a sample whose group is open in the ranks of ``attachments`` (its probe in each)."""
        budget, tokens, cost, done = self.token_budget, self._tokens, self._cost, self._trained
        trained_ok = budget - trained
        best, best_key = None, None
        for r, att in attachments.items():  # rule 1: fewest new tokens, then lowest cost after, then rank
            new = length - att.own_from
            if tokens[r] + new <= budget and done[r] <= trained_ok:
                k = (new, cost[r] + att.new_pairs, r)
                if best_key is None or k < best_key:
                    best, best_key = r, k
        if best is not None:
            return best
        for r, row in enumerate(self._rows):  # rule 2: an empty row
            if not row:
                return r
        others = self._probe_others(ids, key, tkey, list(attachments))
        return self._choose_new(length, trained, others, top=max(cost))

    def _choose_new(
        self, length: int, trained: int, probes: dict[int, Attachment | None], top: int | None = None
    ) -> int | None:
        """The fitting rank of ``probes`` (rank -> the sample's probe there, None: it places every token) of least
        attention cost after adding the sample (ties: lowest rank); with ``top``, only one whose cost after
        stays <= top (rule 2); None when there is none (rule 3)."""
        budget, tokens, cost, done = self.token_budget, self._tokens, self._cost, self._trained
        trained_ok = budget - trained
        pairs = length * (length + 1) // 2
        best, best_after = None, None
        for r, att in probes.items():
            if att is None:
                new, after = length, cost[r] + pairs
            else:
                new, after = length - att.own_from, cost[r] + att.new_pairs
            if tokens[r] + new > budget or done[r] > trained_ok or (top is not None and after > top):
                continue
            if best_after is None or after < best_after:
                best, best_after = r, after
        return best

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
            rows=[self._planned(r, row) for r, row in enumerate(rows)],
            samples_per_row=np.array([len(row) for row in rows], dtype=np.int64),
            tokens_per_row=np.array(self._tokens, dtype=np.int64),
            trained_per_row=np.array(self._trained, dtype=np.int64),
            attn_cost_per_row=np.array(self._cost, dtype=np.int64),
            token_budget=self.token_budget,
            filler_ranks=filler_ranks,
        )
        self._reset()
        return batch

    def _planned(self, rank: int, row: list[TrainingSequence]) -> list[TrainingSequence]:
        """``row`` as a :class:`PlannedRow` carrying its tries' placements in row order (the packer's layout then
        skips computing them); a filler row (no trie) stays a plain list. A trie's samples are inserted in row
        order: with one trie per row its indices are the row's; with one per group, the row indices of the
        group's samples."""
        tries = self._tries[rank]
        if not tries:
            return row
        if self.share_across_groups:
            (trie,) = tries.values()
            parents, own_from, lengths = (
                np.array(x, dtype=np.int64) for x in (trie.parents, trie.own_from, trie.lengths)
            )
        else:
            n = len(row)
            parents, own_from, lengths = (np.empty(n, dtype=np.int64) for _ in range(3))
            members: dict[Hashable, list[int]] = {}
            for i, sample in enumerate(row):
                members.setdefault(group_key(sample), []).append(i)
            for key, trie in tries.items():
                at = np.array(members[key], dtype=np.int64)
                local = np.array(trie.parents, dtype=np.int64)  # indices into ``at``
                parents[at] = np.where(local >= 0, at[np.maximum(local, 0)], -1)
                own_from[at], lengths[at] = trie.own_from, trie.lengths
        return PlannedRow(row, parents, own_from, lengths, self.share_across_groups)


class GroupTreeBudgetPlanner(TreeBudgetPlanner):
    """:class:`TreeBudgetPlanner` over one trie per group (``packing.share_across_groups=false``): groups never
    share tokens, as the :class:`~asyncgrpo_cli.packing.tree.TreePacker` lays them out then."""

    share_across_groups = False
