"""A tree-packed row's layout with array operations over the whole row, once each sample's placement (parent
sample, first own depth: ``packing/trie.py``) is known: which sample's chunk places a depth of a sample's path
(:func:`owners`), where every sample's tokens sit in the row (:func:`path_pieces`) and the depth-first order of
the chunks (:func:`preorder`). Each is a few numpy passes per level of the row's tree, none per sample.
"""

from __future__ import annotations

import numpy as np


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
