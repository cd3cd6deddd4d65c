"""The tree planner's placement rules, compiled: the kernel :class:`~asyncgrpo_cli.packing.tree_planner.
TreeBudgetPlanner` hands its waiting samples to. The rules (1-3) and the costs they compare are the planner's
module docstring's; the rows' tries are ``packing/trie.py``'s.

Why compiled (numba): deciding a sample probes the tries of the rows it may go to, a few dozen branchy integer
operations per trie level, which cost more as Python than the rest of planning together.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from asyncgrpo_cli.packing.trie import NODES, SAMPLES, commit, new_root, probe

# columns of the rows' running totals (``TreeBudgetPlanner._totals``)
TOKENS, TRAINED, COST = range(3)


@njit(cache=True, nogil=True)
def _trie_root(forest_nodes: np.ndarray, homes: np.ndarray, g: int, r: int, share: bool) -> int:
    """The root of the trie a sample of group ``g`` joins in row ``r`` (-1: none, it places every token): the row's
    trie (node 0) once the row holds anything; with one trie per group, the group's trie in that row."""
    if share:
        return 0 if forest_nodes[r] > 0 else -1
    return homes[g, r]


@njit(cache=True, nogil=True)
def _choose_new(
    nodes, store, counts, walk, totals, homes, ids, g, tr, budget, share, candidates, top
) -> int:  # pragma: no cover - compiled
    """The fitting row among ``candidates`` of least attention cost after adding the sample (ties: lowest rank);
    with ``top >= 0`` only one whose cost after stays <= top (rule 2); -1 when there is none (rule 3)."""
    length = ids.shape[0]
    pairs = length * (length + 1) // 2
    best, best_after = -1, 0
    for r in range(totals.shape[0]):
        if not candidates[r]:
            continue
        root = _trie_root(counts[:, NODES], homes, g, r, share)
        if root < 0:
            new, after = length, totals[r, COST] + pairs
        else:
            own = probe(nodes[r], store[r], root, ids, walk[r])
            new, after = length - own, totals[r, COST] + (length * (length + 1) - own * (own + 1)) // 2
        if totals[r, TOKENS] + new > budget or totals[r, TRAINED] > budget - tr or (top >= 0 and after > top):
            continue
        if best < 0 or after < best_after:
            best, best_after = r, after
    return best


@njit(cache=True, nogil=True)
def place(
    nodes, store, meta, counts, walk, totals, homes, cat, lengths, trained, flags, flag_ends, group, start, budget,
    share, assign, rooms,
) -> int:  # pragma: no cover - compiled  # fmt: skip
    """Place samples ``start, start + 1, ...`` (sample i: ``lengths[i]`` ids in ``cat`` after sample i - 1's, group
    ``group[i]``) by the tree planner's rules into the rows' tries (``assign[i]``: the row), updating
    ``totals`` (per row: tokens, trained, cost) and ``homes`` (per group and row: its trie root, -1 none; 0 when
    the row shares one trie). ``walk[r]`` holds the sample's probe of row r's trie (each rule probes the rows it
    considers). ``trained[i]``: sample i's trained tokens, counted here first when ``flags`` holds the samples'
    boolean masks one after another (sample i's ending at ``flag_ends[i]``, or where its ids end when
    ``flag_ends`` is empty). Returns the index of the first sample no row may take (it closes the micro-batch;
    nothing of it is placed), or the number of samples when every one was placed; then ``rooms[r]`` is row r's
    room: the budget minus its forwarded or trained tokens, whichever is larger."""
    offsets = np.empty(lengths.shape[0] + 1, dtype=np.int64)
    offsets[0] = 0
    for i in range(lengths.shape[0]):
        offsets[i + 1] = offsets[i] + lengths[i]
    if flags.shape[0]:  # boolean masks, one after another: count each sample's trained tokens here
        at = 0
        for i in range(trained.shape[0]):
            end = flag_ends[i] if flag_ends.shape[0] else offsets[i + 1]
            c = 0
            for t in range(at, end):
                c += flags[t]
            trained[i], at = c, end
    ranks = totals.shape[0]
    candidates = np.zeros(ranks, dtype=np.bool_)
    for i in range(start, offsets.shape[0] - 1):
        ids = cat[offsets[i] : offsets[i + 1]]
        length, tr, g = ids.shape[0], trained[i], group[i]
        rank, best_new, best_after = -1, 0, 0
        held = False
        for r in range(ranks):  # rule 1: fewest new tokens, then lowest cost after, then lowest rank
            if homes[g, r] < 0:
                continue
            held = True
            own = probe(nodes[r], store[r], _trie_root(counts[:, NODES], homes, g, r, share), ids, walk[r])
            new = length - own
            if totals[r, TOKENS] + new > budget or totals[r, TRAINED] > budget - tr:
                continue
            after = totals[r, COST] + (length * (length + 1) - own * (own + 1)) // 2
            if rank < 0 or new < best_new or (new == best_new and after < best_after):
                rank, best_new, best_after = r, new, after
        if held and rank < 0:
            for r in range(ranks):  # rule 2: an empty row
                if counts[r, SAMPLES] == 0:
                    rank = r
                    break
            if rank < 0:  # rule 2: a row it does not make the costliest
                for r in range(ranks):
                    candidates[r] = homes[g, r] < 0
                top = totals[0, COST]
                for r in range(1, ranks):
                    top = max(top, totals[r, COST])
                rank = _choose_new(
                    nodes, store, counts, walk, totals, homes, ids, g, tr, budget, share, candidates, top
                )
        elif not held:  # rule 3
            candidates[:] = True
            rank = _choose_new(
                nodes, store, counts, walk, totals, homes, ids, g, tr, budget, share, candidates, -1
            )
        if rank < 0:
            _fill_rooms(totals, budget, rooms)
            return i
        root = _trie_root(counts[:, NODES], homes, g, rank, share)
        if root < 0:  # the row has no trie this sample joins: a new one (else the rules probed the row's)
            root = new_root(nodes[rank], counts[rank])
            probe(nodes[rank], store[rank], root, ids, walk[rank])
        own = commit(nodes[rank], store[rank], meta[rank], counts[rank], ids, walk[rank])
        homes[g, rank] = root
        totals[rank, TOKENS] += length - own
        totals[rank, TRAINED] += tr
        totals[rank, COST] += (length * (length + 1) - own * (own + 1)) // 2
        assign[i] = rank
    _fill_rooms(totals, budget, rooms)
    return offsets.shape[0] - 1


@njit(cache=True, nogil=True)
def _fill_rooms(totals: np.ndarray, budget: int, rooms: np.ndarray) -> None:  # pragma: no cover - compiled
    """``rooms[r]``: row r's room, the budget minus its forwarded or trained tokens, whichever is larger."""
    for r in range(totals.shape[0]):
        rooms[r] = budget - max(totals[r, TOKENS], totals[r, TRAINED])
