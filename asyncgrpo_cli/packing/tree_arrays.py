"""A tree-packed row's placements with array operations over the whole row: the tries of ``packing/trie.py``
without inserting samples one by one.

Samples are inserted into *tries*: by default one per row, so that groups whose prompts share a prefix (a system
prompt, few-shot examples) share it; one per group with ``packing.share_across_groups=false``. The caller numbers
each sample's trie (``trie``).

What insertion decides for sample j (rules in ``packing/trie.py``) depends on three numbers: ``m``, its longest
common prefix (LCP) with an earlier sample of its trie; ``i*``, the earliest sample sharing those m tokens; and
whether an earlier sample of length > m shares them (node m-1 has a child). They come from the samples in
sorted order, where the LCP of two samples is the minimum of the adjacent LCPs between them (a
lexicographic-order property), so no pair is compared token by token and nothing is quadratic in the row:

  1. sort the row's samples by (trie, token ids lexicographically, row index) (Python's sort on ``bytes``:
     memcmp), so each trie is one run and identical samples keep row order;
  2. the LCP of each adjacent pair in that order (0 across tries): one vectorized comparison per pair, from the
     prefix known to be shared to min(L_a, L_b). Known shared: the LCP of the trie's first and last samples in
     that order, and for two samples of one group the LCP of the group's first and last (every sample sorted
     between two others shares their common prefix), so a system prompt is compared once per trie and a group's
     prompt once per group, not once per sample;
  3. the earlier samples nearest to j on either side in sorted order (the previous and next smaller row index):
     the LCP with any earlier sample is at most the LCP with the nearer of them on its side, so ``m`` is the
     larger of those two LCPs;
  4. the samples sharing m tokens with j are the sorted interval [lo, hi] around it where the adjacent LCPs stay
     >= m; ``i*`` is its smallest row index. Those of length exactly m (equal to j's first m tokens) sort first
     in it, one run of identical samples; node m-1 has a child iff an earlier sample lies after that run.

Range minima (of row indices and of adjacent LCPs) are sparse tables, and the searches in 3 and 4 binary lifting
over them, both kept within a trie: O(n log G) array work per row, n samples in tries of at most G.
"""

from __future__ import annotations

import numpy as np


def adjacent_lcp(
    cat: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    skip: np.ndarray | None = None,
) -> np.ndarray:
    """int64 [P]: the LCP of samples ``a[p]`` and ``b[p]`` (flat ids ``cat``, sample ``s`` at ``starts[s]``),
    given that their first ``skip[p]`` tokens are known equal: one vectorized comparison of the tokens from
    ``skip[p]`` to min(L_a, L_b) of every pair, the first mismatch of each pair found by its index."""
    skip = np.zeros(a.shape[0], dtype=np.int64) if skip is None else skip
    k = np.minimum(lengths[a], lengths[b]) - skip
    ends = np.cumsum(k)
    within = np.arange(int(ends[-1]) if k.size else 0) - np.repeat(ends - k, k)
    neq = np.flatnonzero(
        cat[np.repeat(starts[a] + skip, k) + within] != cat[np.repeat(starts[b] + skip, k) + within]
    )
    pair = np.searchsorted(ends, neq, side="right")
    first = np.ones(pair.shape[0], dtype=bool)
    first[1:] = pair[1:] != pair[:-1]
    lcp = k.copy()
    lcp[pair[first]] = within[neq[first]]
    return lcp + skip


def placements(
    cat: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    trie: np.ndarray,
    group: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(parent, own_from) int64 [n] of each sample of a row: the row index of the earlier sample whose path it
    shares below ``own_from`` (-1: none), and its first own depth, exactly as inserting each trie's samples in
    row order into a :class:`~asyncgrpo_cli.packing.trie.GroupTrie` gives them. ``trie``: int64 [n], the trie of
    each sample (numbered 0, 1, ...); ``group``: int64 [n] (numbered alike) or None (the tries are the groups):
    the GRPO groups, whose shared prompts step 2 of the module docstring skips."""
    n = lengths.shape[0]
    raw = cat.tobytes()
    keys = [raw[8 * s : 8 * (s + n_)] for s, n_ in zip(starts.tolist(), lengths.tolist(), strict=True)]
    order = np.array([i for _, _, i in sorted(zip(trie.tolist(), keys, range(n)))], dtype=np.int64)
    lo, hi = order[:-1], order[1:]
    same = trie[lo] == trie[hi]
    begins = np.flatnonzero(np.concatenate([[True], ~same]))  # first sorted position of each trie
    ends = np.append(begins[1:], n) - 1
    skip = adjacent_lcp(cat, starts, lengths, order[begins], order[ends])[np.cumsum(~same)]
    if group is not None:  # two samples of one group (in one trie) also share the group's own prefix
        cell = np.unique(trie * (int(group.max()) + 1) + group, return_inverse=True)[1].reshape(-1)
        if int(cell.max()) > int(trie.max()):  # some trie holds several groups (else: known already)
            rank = np.empty(n, dtype=np.int64)
            rank[order] = np.arange(n)
            own = _cell_shared(cat, starts, lengths, cell, rank)
            skip = np.where(cell[lo] == cell[hi], np.maximum(skip, own[cell[hi]]), skip)
    pairs = np.flatnonzero(same)
    adj = np.zeros(n, dtype=np.int64)  # adj[p]: LCP of sorted p - 1 and p (0 at p = 0 and across tries)
    adj[pairs + 1] = adjacent_lcp(cat, starts, lengths, lo[pairs], hi[pairs], skip[pairs])
    # Per sorted position: its trie (counted in sort order), its row index (earlier = smaller) shifted so that
    # every other trie looks earlier on the left (``before``) and on the right (``beyond``): each search then
    # stops at its trie's ends and needs only log2(largest trie) levels.
    tid = np.concatenate([[0], np.cumsum(~same)])
    levels = int(np.bincount(tid).max()).bit_length()
    t, length = order, lengths[order]
    before, beyond = _SparseMin(t + n * tid, levels), _SparseMin(t - n * tid, levels)
    adj_min = _SparseMin(adj, levels)
    pos = np.arange(n, dtype=np.int64)
    left = before.reach_left(pos, before.values) - 1  # nearest earlier sample before p (or another trie's)
    right = beyond.reach_right(pos, beyond.values) + 1  # nearest earlier sample after p (n: none)
    has_right = right < n
    right_lcp = adj_min.query(np.where(has_right, pos + 1, pos), np.where(has_right, right, pos))
    m = np.maximum(np.where(left >= 0, adj_min.query(left + 1, pos), 0), np.where(has_right, right_lcp, 0))
    # The interval sharing m tokens with p (adjacent LCPs are 0 across tries); a root's is itself.
    floor = np.where(m > 0, m - 1, np.iinfo(np.int64).max)
    lo_m, hi_m = adj_min.reach_left(pos, floor, shift=1), adj_min.reach_right(pos, floor)
    first = before.query(lo_m, hi_m) - n * tid
    run = np.cumsum(np.concatenate([[True], (adj[1:] != length[1:]) | (length[1:] != length[:-1])])) - 1
    run_end = np.append(np.flatnonzero(np.diff(run)), n - 1)  # last position of each identical run
    after = np.where(length[lo_m] == m, run_end[run[lo_m]] + 1, lo_m)  # past the samples of length m
    has_child = (after <= hi_m) & (before.query(np.minimum(after, hi_m), hi_m) < before.values)
    own_sorted = np.where(m == length, length, np.where(has_child, m - 1, m))
    parent, own_from = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    parent[t] = np.where(m > 0, first, -1)
    own_from[t] = np.where(m > 0, own_sorted, 0)
    return parent, own_from


class _SparseMin:
    """Range minima of ``values`` (int64 [n]) over windows of up to 2^(levels - 1): level k holds the minimum of
    each window of 2^k (a sparse table)."""

    def __init__(self, values: np.ndarray, levels: int) -> None:
        n = values.shape[0]
        self.values, self.n = values, n
        self.table = np.full((levels, n), np.iinfo(np.int64).max, dtype=np.int64)
        self.table[0] = values
        for k in range(1, levels):
            half = 1 << (k - 1)
            np.minimum(self.table[k - 1, : n - half], self.table[k - 1, half:], out=self.table[k, : n - half])

    def query(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """min(values[lo[i] .. hi[i]]) for each i (lo <= hi)."""
        k = np.log2(hi - lo + 1).astype(np.int64)
        return np.minimum(self.table[k, lo], self.table[k, hi - (1 << k) + 1])

    def reach_left(self, pos: np.ndarray, floor: np.ndarray, shift: int = 0) -> np.ndarray:
        """The smallest x <= pos[i] such that every value at [x + shift, pos[i] + shift - 1] is > floor[i]
        (binary lifting: one step per level, the largest first)."""
        cur = pos.copy()
        for k in range(self.table.shape[0] - 1, -1, -1):
            step = cur - (1 << k)
            ok = np.flatnonzero(step >= 0)
            ok = ok[self.table[k, step[ok] + shift] > floor[ok]]
            cur[ok] = step[ok]
        return cur

    def reach_right(self, pos: np.ndarray, floor: np.ndarray) -> np.ndarray:
        """The largest x >= pos[i] such that every value at [pos[i] + 1, x] is > floor[i]."""
        cur = pos.copy()
        for k in range(self.table.shape[0] - 1, -1, -1):
            step = cur + (1 << k)
            ok = np.flatnonzero(step < self.n)
            ok = ok[self.table[k, cur[ok] + 1] > floor[ok]]
            cur[ok] = step[ok]
        return cur


def _cell_shared(
    cat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, cell: np.ndarray, rank: np.ndarray
) -> np.ndarray:
    """int64 [cells]: the LCP of the first and last sample of each cell (the samples of one group in one trie,
    numbered 0, 1, ...) in sort order (``rank``: each sample's position in it). Every sample of the cell sorts
    between the two, so any two of them share that prefix."""
    by = np.lexsort((rank, cell))
    sizes = np.bincount(cell)
    first = np.cumsum(sizes) - sizes
    return adjacent_lcp(cat, starts, lengths, by[first], by[first + sizes - 1])


def owners(parent: np.ndarray, own_from: np.ndarray, sample: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """The sample whose chunk places depth ``depth[t]`` on sample ``sample[t]``'s path, for every t: up the
    parents while the depth is above the sample's own chunk (as many passes as the longest parent chain)."""
    cur = sample.copy()
    todo = np.flatnonzero(depth < own_from[cur])
    while todo.size:
        cur[todo] = parent[cur[todo]]
        todo = todo[depth[todo] < own_from[cur[todo]]]
    return cur


def path_pieces(
    parent: np.ndarray, own_from: np.ndarray, lengths: np.ndarray, chunk_start: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(flat start, packed shift) int64 [K] of the *pieces* of every sample's path, in token order.

    Sample s's path is a few pieces, one per sample up its parent chain: s's own chunk places depths
    [own_from[s], L_s), its parent's chunk the depths below that down to the parent's own_from, and so on to a
    root chunk (own_from 0); found per sample, one pass per chain level. A piece covers flat tokens (samples one
    after another) from its start to the next piece's; token f of a piece sits at packed position f + shift.
    """
    n = lengths.shape[0]
    pieces_s, pieces_lo, pieces_c = [], [], []
    alive, cur, hi = np.arange(n), np.arange(n), lengths.copy()
    while alive.size:
        lo = own_from[cur]
        keep = lo < hi
        pieces_s.append(alive[keep])
        pieces_lo.append(lo[keep])
        pieces_c.append(cur[keep])
        hi = np.minimum(hi, lo)
        more = hi > 0
        alive, cur, hi = alive[more], parent[cur[more]], hi[more]
    s, lo, c = (np.concatenate(x) for x in (pieces_s, pieces_lo, pieces_c))
    order = np.lexsort((lo, s))
    s, lo, c = s[order], lo[order], c[order]
    flat = (np.cumsum(lengths) - lengths)[s] + lo
    return flat, chunk_start[c] - own_from[c] + lo - flat


def preorder(anchor: np.ndarray, anchor_depth: np.ndarray, group: np.ndarray) -> np.ndarray:
    """The depth-first order of a row's chunks (indices into the arrays given, one entry per placed chunk).

    ``anchor[c]``: index of the chunk ``c`` hangs below (-1: a root), ``anchor_depth[c]`` the depth it hangs at.
    Roots come group by group (``group``), then in index order; a chunk's children follow it, the deepest anchor
    first, then the earliest index. Each chunk gets its root-to-chunk path of sort keys, and one ``lexsort``
    over the paths (a prefix, the ancestor, sorts first) is that order.
    """
    p = anchor.shape[0]
    n1 = p + 1
    top = int(anchor_depth.max(initial=0)) + 1
    key = np.where(anchor < 0, group * n1, (top - anchor_depth) * n1) + np.arange(p)
    level = np.zeros(p, dtype=np.int64)
    cur = anchor.copy()
    while (up := np.flatnonzero(cur >= 0)).size:
        level[up] += 1
        cur[up] = anchor[cur[up]]
    path = np.full((p, int(level.max(initial=0)) + 1), -1, dtype=np.int64)
    rows, cur, at = np.arange(p), np.arange(p), level.copy()
    while rows.size:
        path[rows, at] = key[cur]
        keep = anchor[cur] >= 0
        rows, cur, at = rows[keep], anchor[cur[keep]], at[keep] - 1
    return np.lexsort(path.T[::-1])
