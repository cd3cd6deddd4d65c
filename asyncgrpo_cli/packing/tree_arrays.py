"""A tree-packed row's arrays from its samples' placements, compiled: the layout, the attention intervals, the
multiplicities and the loss terms' positions, in a few passes over the row's chunks and tokens.

Input: the samples' ids one after another (``cat``, sample ``s`` at ``offsets[s]:offsets[s + 1]``), each sample's
placement (``parent``, ``own_from``: ``packing/trie.py``) and its group's rank (order of first appearance).
A sample with ``own_from < L`` places a *chunk*, depths [own_from, L); its *anchor* is the chunk that places depth
``own_from - 1`` on its path (up its parents to the first that places it; none for own_from 0). The chunks are
laid out depth-first: roots group by group, then in row order; a chunk's children follow it, the deepest anchor
first, then in row order. Every position then gets its token, depth and parent position; segments (maximal
unary chains) and their subtrees give ``leave``. A sample's path is the pieces of its parent chain's chunks, which
also locate every trained token's predecessor.

Why compiled (numba): each step is a loop over chunks or tokens with a parent walk or a stack. As numpy passes
over the whole row they took ~1.7 us a sample (a lexsort over root-to-chunk key paths, one pass per tree level
for the anchors, pieces and subtrees); compiled, the whole row takes ~0.2 us a sample (``docs/benchmarks.md``).
Subtree ends are ``attention.subtree_spans``, the same pass ``attention.segment_leave`` checks segments with.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from asyncgrpo_cli.packing.attention import subtree_spans


@njit(cache=True, nogil=True)
def _anchor(parent: np.ndarray, own_from: np.ndarray, s: int, depth: int) -> int:
    """The sample whose chunk places ``depth`` on sample ``s``'s path (``depth < L_s``)."""
    p = s
    while depth < own_from[p]:
        p = parent[p]
    return p


@njit(cache=True, nogil=True)
def layout(
    cat: np.ndarray, offsets: np.ndarray, parent: np.ndarray, own_from: np.ndarray, group: np.ndarray
):  # pragma: no cover - compiled
    """(input_ids, position_ids, leave, segment_offsets, segment_parents, multiplicity, chunk_start) of the row;
    ``chunk_start[s]``: the position of sample s's chunk (-1: it places none). ``multiplicity[p]``: how many
    samples have position p on their path."""
    n = offsets.shape[0] - 1
    lengths = offsets[1:] - offsets[:-1]
    # 1. chunks, their anchors, and the depth-first order (sort keys: anchor, then roots by group, children by
    #    anchor depth descending, then row order; stable sorts on the keys, last key first)
    anchor = np.full(n, -1, dtype=np.int64)
    chunks = np.flatnonzero(own_from < lengths)
    top = 0
    for s in chunks:
        if own_from[s] > 0:
            anchor[s] = _anchor(parent, own_from, parent[s], own_from[s] - 1)
        top = max(top, own_from[s])
    second = np.empty(chunks.shape[0], dtype=np.int64)
    for i in range(chunks.shape[0]):
        s = chunks[i]
        second[i] = group[s] if anchor[s] < 0 else top - own_from[s]
    by = chunks[np.argsort(second, kind="mergesort")]
    key = np.empty(by.shape[0], dtype=np.int64)
    for i in range(by.shape[0]):
        key[i] = anchor[by[i]]
    by = by[np.argsort(key, kind="mergesort")]
    first_child = np.full(n, -1, dtype=np.int64)
    num_children = np.zeros(n, dtype=np.int64)
    roots = 0
    for i in range(by.shape[0]):
        a = anchor[by[i]]
        if a < 0:
            roots += 1
        else:
            if first_child[a] < 0:
                first_child[a] = i
            num_children[a] += 1
    chunk_start = np.full(n, -1, dtype=np.int64)
    order = np.empty(by.shape[0], dtype=np.int64)
    stack = np.empty(by.shape[0], dtype=np.int64)
    sp = 0
    for i in range(roots - 1, -1, -1):
        stack[sp] = by[i]
        sp += 1
    pos, k = 0, 0
    while sp > 0:
        sp -= 1
        c = stack[sp]
        chunk_start[c] = pos
        pos += lengths[c] - own_from[c]
        order[k] = c
        k += 1
        f = first_child[c]
        if f >= 0:
            for i in range(f + num_children[c] - 1, f - 1, -1):
                stack[sp] = by[i]
                sp += 1
    total = pos
    # 2. tokens: id, depth, parent position
    input_ids = np.empty(total, dtype=np.int64)
    position_ids = np.empty(total, dtype=np.int64)
    parent_pos = np.empty(total, dtype=np.int64)
    for c in order:
        base, o, src = chunk_start[c], own_from[c], offsets[c]
        for t in range(lengths[c] - o):
            input_ids[base + t] = cat[src + o + t]
            position_ids[base + t] = o + t
            parent_pos[base + t] = base + t - 1
        a = anchor[c]
        parent_pos[base] = -1 if a < 0 else chunk_start[a] + o - 1 - own_from[a]
    # 3. segments: a new one at a root, at a token not below its left neighbour, and after a fork
    children = np.zeros(total, dtype=np.int64)
    for p in range(total):
        if parent_pos[p] >= 0:
            children[parent_pos[p]] += 1
    seg_of = np.empty(total, dtype=np.int64)
    starts = np.empty(total + 1, dtype=np.int64)
    num_seg = 0
    for p in range(total):
        if p == 0 or parent_pos[p] != p - 1 or children[p - 1] >= 2:
            starts[num_seg] = p
            num_seg += 1
        seg_of[p] = num_seg - 1
    starts[num_seg] = total
    segment_offsets = starts[: num_seg + 1].copy()
    segment_parents = np.empty(num_seg, dtype=np.int64)
    for g in range(num_seg):
        head = parent_pos[segment_offsets[g]]
        segment_parents[g] = -1 if head < 0 else seg_of[head]
    # 4. leave: each segment's subtree ends where its last descendant does
    sub_end, _ = subtree_spans(segment_offsets, segment_parents)
    leave = np.empty(total, dtype=np.int64)
    for p in range(total):
        leave[p] = sub_end[seg_of[p]]
    # 5. multiplicity: samples whose last token lies in [p, leave[p])
    below = np.zeros(total + 1, dtype=np.int64)
    for s in range(n):
        last = lengths[s] - 1
        c = _anchor(parent, own_from, s, last)
        below[chunk_start[c] + last - own_from[c] + 1] += 1
    for p in range(total):
        below[p + 1] += below[p]
    multiplicity = np.empty(total, dtype=np.int64)
    for p in range(total):
        multiplicity[p] = below[leave[p]] - below[p]
    return input_ids, position_ids, leave, segment_offsets, segment_parents, multiplicity, chunk_start


@njit(cache=True, nogil=True)
def trained_terms(
    offsets: np.ndarray, parent: np.ndarray, own_from: np.ndarray, chunk_start: np.ndarray, mask: np.ndarray
):  # pragma: no cover - compiled
    """(flat, pred_index, sample_index, trained, bad) of the row's trained tokens (``mask`` one byte a token, the
    samples' masks one after another): each trained token's flat index, its predecessor's packed position, its
    sample; per sample its count. ``bad``: the first sample that trains its token 0 (it has no predecessor: the
    caller names it; the arrays are then empty), else -1."""
    n = offsets.shape[0] - 1
    count = 0
    for s in range(n):
        if offsets[s + 1] > offsets[s] and mask[offsets[s]] != 0:
            none = np.zeros(0, dtype=np.int64)
            return none, none, none, np.zeros(n, dtype=np.int64), s
    for t in range(offsets[n]):
        count += mask[t] != 0
    flat = np.empty(count, dtype=np.int64)
    pred = np.empty(count, dtype=np.int64)
    owner = np.empty(count, dtype=np.int64)
    trained = np.zeros(n, dtype=np.int64)
    piece_lo = np.empty(n + 1, dtype=np.int64)
    piece_chunk = np.empty(n + 1, dtype=np.int64)
    k = 0
    for s in range(n):
        off, length = offsets[s], offsets[s + 1] - offsets[s]
        m, hi, cur = 0, length, s  # the pieces of s's path, deepest first (path_pieces of the docstring)
        while hi > 0:
            lo = own_from[cur]
            if lo < hi:
                piece_lo[m], piece_chunk[m] = lo, cur
                m += 1
                hi = lo
            if hi > 0:
                cur = parent[cur]
        j = m - 1
        for t in range(1, length):
            if mask[off + t] != 0:
                d = t - 1
                while j > 0 and piece_lo[j - 1] <= d:
                    j -= 1
                c = piece_chunk[j]
                flat[k] = off + t
                pred[k] = chunk_start[c] + d - own_from[c]
                owner[k] = s
                k += 1
    for i in range(count):
        trained[owner[i]] += 1
    return flat, pred, owner, trained, -1


@njit(cache=True, nogil=True)
def positions(
    offsets: np.ndarray, parent: np.ndarray, own_from: np.ndarray, chunk_start: np.ndarray
) -> np.ndarray:  # pragma: no cover - compiled
    """int64 [Σ L]: the packed position of every token of every sample (its root-to-leaf path)."""
    n = offsets.shape[0] - 1
    out = np.empty(offsets[n], dtype=np.int64)
    for s in range(n):
        off = offsets[s]
        for d in range(offsets[s + 1] - off):
            c = _anchor(parent, own_from, s, d)
            out[off + d] = chunk_start[c] + d - own_from[c]
    return out
