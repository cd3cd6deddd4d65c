"""A tree-packed row's placements with array operations over the whole row: the tries of ``packing/trie.py``
without inserting samples one by one.

Samples are inserted into *tries*: one per group (``packing.share_across_groups=false``) or, by default, one
per row, so that groups whose prompts share a prefix (a system prompt, few-shot examples) share it too. Two
samples with different first tokens share nothing, so a row's trie splits into independent sub-tries, one per
first token; the caller numbers those (``trie``) and the work below is per sub-trie, as it was per group.

What insertion decides for sample j of a trie (rules in ``packing/trie.py``) depends on three numbers: ``m``,
its longest common prefix (LCP) with an earlier sample of the trie; ``i*``, the earliest sample reaching it; and
whether an earlier sample of length > m reaches it (node m-1 has a child). They come from all pairwise LCPs of
the trie, found without comparing every pair token by token:

  1. sort the row's samples by (trie, token ids lexicographically, row index) (Python's sort on ``bytes``:
     memcmp), so each trie is one run and identical samples keep row order;
  2. the LCP of each adjacent pair in that order: one vectorized comparison per pair, from the prefix known to
     be shared to min(L_a, L_b). Known shared: the LCP of the trie's first and last samples in that order, and
     for two samples of one group the LCP of the group's first and last (every sample sorted between two others
     shares their common prefix), so a system prompt is compared once per trie and a group's prompt once per
     group, not once per sample;
  3. the LCP of any two samples of a trie is the minimum of the adjacent LCPs between them in sorted order (a
     lexicographic-order property), so one ``minimum.accumulate`` over a [tries, n, n] array gives every pair;
  4. permuted back to insertion order, ``m`` / ``i*`` / "has a child" are a masked max, argmax (earliest on
     ties) and any over the earlier samples of each trie.

Rows whose padded [tries, n, n] array would be large (one trie of thousands of samples) use
:class:`~asyncgrpo_cli.packing.trie.GroupTrie` instead (:data:`MAX_PAIRS`): the same numbers, per sample.
"""

from __future__ import annotations

import numpy as np

from asyncgrpo_cli.packing.trie import GroupTrie

MAX_PAIRS = 1 << 21
"""Largest tries x n x n array step 3 builds; above it :func:`placements` inserts into :class:`GroupTrie`."""


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
    row order into a :class:`GroupTrie` gives them. ``trie``: int64 [n], the trie of each sample, numbered
    0, 1, ... ; ``group``: int64 [n] (numbered alike) or None (the tries are the groups): the GRPO groups, whose
    shared prompts step 2 of the module docstring skips."""
    n = lengths.shape[0]
    sizes = np.bincount(trie)
    ng, gmax = sizes.shape[0], int(sizes.max())
    if ng * gmax * gmax > MAX_PAIRS:
        return _with_tries(cat, starts, lengths, trie)
    raw = cat.tobytes()
    keys = [raw[8 * s : 8 * (s + n_)] for s, n_ in zip(starts.tolist(), lengths.tolist(), strict=True)]
    order = np.array([i for _, _, i in sorted(zip(trie.tolist(), keys, range(n)))], dtype=np.int64)
    gstart = np.cumsum(sizes) - sizes
    spos = np.empty(n, dtype=np.int64)  # sorted position within the trie
    spos[order] = np.arange(n) - gstart[trie[order]]
    by_trie = np.argsort(trie, kind="stable")
    ipos = np.empty(n, dtype=np.int64)  # insertion (row-order) position within the trie
    ipos[by_trie] = np.arange(n) - gstart[trie[by_trie]]
    big = np.iinfo(np.int64).max
    adj = np.full((ng, gmax), big, dtype=np.int64)  # adj[g, p]: LCP of sorted p - 1 and p
    # The LCP of a trie's lexicographically first and last samples is the prefix all of its samples share
    # (the prompt, usually): adjacent pairs are compared from there on only.
    shared = adjacent_lcp(cat, starts, lengths, order[gstart], order[gstart + sizes - 1])
    same = np.flatnonzero(trie[order[:-1]] == trie[order[1:]])
    lo, hi = order[same], order[same + 1]
    skip = shared[trie[hi]]
    if group is not None:  # two samples of one group also share the group's own prefix
        own = _group_shared(cat, starts, lengths, group, spos + gstart[trie])
        skip = np.where(group[lo] == group[hi], np.maximum(skip, own[group[hi]]), skip)
    adj[trie[hi], spos[hi]] = adjacent_lcp(cat, starts, lengths, lo, hi, skip)
    col = np.arange(gmax)
    upper = np.where(col[None, None, :] > col[None, :, None], adj[:, None, :], big)
    lcp_sorted = np.minimum.accumulate(upper, axis=2)
    lcp_sorted = np.minimum(lcp_sorted, lcp_sorted.transpose(0, 2, 1))
    perm = np.zeros((ng, gmax), dtype=np.int64)  # perm[g, t]: sorted position of the t-th sample of g
    perm[trie, ipos] = spos
    member = np.zeros((ng, gmax), dtype=np.int64)
    member[trie, ipos] = np.arange(n)
    lens = np.zeros((ng, gmax), dtype=np.int64)
    lens[trie, ipos] = lengths
    gi = np.arange(ng)[:, None, None]
    lcp = lcp_sorted[gi, perm[:, :, None], perm[:, None, :]]  # [g, earlier t_i, later t_j]
    valid = (col[None, :, None] < col[None, None, :]) & (col[None, None, :] < sizes[:, None, None])
    masked = np.where(valid, lcp, -1)
    m_all, best_all = masked.max(axis=1), masked.argmax(axis=1)
    child_all = (valid & (lcp == m_all[:, None, :]) & (lens[:, :, None] > m_all[:, None, :])).any(axis=1)
    m, has_child = m_all[trie, ipos], child_all[trie, ipos]
    best = member[trie, best_all[trie, ipos]]
    root = m <= 0
    own_from = np.where(m == lengths, lengths, np.where(has_child, m - 1, m))
    return np.where(root, -1, best), np.where(root, 0, own_from)


def _group_shared(
    cat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, group: np.ndarray, rank: np.ndarray
) -> np.ndarray:
    """int64 [groups]: the LCP of each group's first and last sample in sort order (``rank``: each sample's
    position in it). Every sample of the group sorts between the two, so any two of them share that prefix (a
    group spread over several tries has samples of different first tokens: 0)."""
    by = np.lexsort((rank, group))
    sizes = np.bincount(group)
    first = np.cumsum(sizes) - sizes
    return adjacent_lcp(cat, starts, lengths, by[first], by[first + sizes - 1])


def _with_tries(cat, starts, lengths, trie) -> tuple[np.ndarray, np.ndarray]:
    """:func:`placements` by inserting each trie's samples into a :class:`GroupTrie` (row order)."""
    tries: dict[int, tuple[GroupTrie, list[int]]] = {}
    parent = np.empty(lengths.shape[0], dtype=np.int64)
    own_from = np.empty(lengths.shape[0], dtype=np.int64)
    for i, (g, s, n) in enumerate(zip(trie.tolist(), starts.tolist(), lengths.tolist(), strict=True)):
        trie, members = tries.setdefault(g, (GroupTrie(), []))
        att = trie.insert(cat[s : s + n])
        parent[i] = members[att.parent] if att.parent >= 0 else -1
        own_from[i] = att.own_from
        members.append(i)
    return parent, own_from


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
