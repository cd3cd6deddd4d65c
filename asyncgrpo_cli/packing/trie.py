"""Prefix tries of samples, compiled: what a sample adds to a tree-packed row, for the tree planner and packer.

A tree-packed row holds one trie over all of its samples (``packing.share_across_groups``, the default), so groups
whose prompts share a prefix share it, or one trie per group (:func:`group_key`). The rules below are the same
either way: a trie does not know which group a sample came from.

Placements. A trie node is a distinct token-id prefix. A node is forwarded once per *placement*: a node with
c >= 2 children (distinct next tokens) is placed c times, once at the head of each child's branch; any other
node is placed once. This is the duplication of the reference's worked example: a position predicts one next
token, so ``p3`` followed by ``a1`` in one rollout and by ``b1`` in another is forwarded twice. A sample that
ends on a node (a prefix of another sample, or an identical sample) predicts nothing from it and reuses an
existing placement. Forwarded tokens of a group = Σ_nodes max(1, children); attention pairs = Σ over placements
of (depth + 1), since a placement sees exactly its root-to-node path.

Samples are inserted in order. With ``m`` the longest common prefix of sample j with an earlier sample, ``i*``
the earliest sample reaching it and ``L`` the sample's length:

    m == 0                        a new root: j places depths [0, L)
    m == L                        contained (prefix of / equal to i*): j places nothing, its path is i*'s
    0 < m < L, node m-1 has a     node m-1 branches: j places depths [m-1, L) (its own copy of the last
      child already              shared token), hanging below i*'s placement at depth m-2 (a root if m == 1)
    0 < m < L, otherwise          every earlier sample through node m-1 ends there: j extends that leaf,
                                  placing depths [m, L) below i*'s placement at depth m-1

The tries live in a :class:`Forest`: numpy arrays holding any number of compressed tries (radix trees) whose
samples are numbered together (a row's samples in row order, so a parent is a row index). An edge covers depths
[start, end) and its tokens sit in the forest's token store; its lower node keeps the earliest sample below it,
its first child and its next sibling (the newest child first). A probe walks down from a root: at each node a
scan of its children for the next token, then one compare loop along the edge. The match ends at depth ``m``;
``i*`` is the earliest sample below that point; node m-1 has a child iff the match stopped inside an edge or at a
node with children. A commit splits the edge the match stopped in and hangs the sample's rest below.

Why compiled (numba, which vLLM itself installs): the walk is a few dozen branchy integer operations per trie level
on the sample's path, which cost ~3.4 us a sample as Python objects and dicts, and a numpy call costs more than
that. Compiled, inserting a 2,000-sample step's samples takes ~0.3 us each (``docs/benchmarks.md``). A compiled
call from Python costs ~1 us, so callers hand over many samples per call: the planner batches what it cannot have
to decide yet (``packing/tree_planner.py``), the packer places a whole row (:func:`placements`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np
from numba import njit

# A node's fields (columns of ``Forest.nodes``).
START, END, SRC, FIRST, CHILD, NEXT = range(6)
# ``Forest.counts``: nodes, store tokens and samples used; forwarded tokens and attention pairs of the samples.
NODES, STORE, SAMPLES, TOKENS, PAIRS = range(5)
# A probe's result (``Forest.walk``): match depth, the node it stopped at, the edge it stopped in (-1: none),
# and the sample's attachment (parent, own_from).
W_M, W_NODE, W_CHILD, W_PARENT, W_OWN = range(5)
# ``Forest.meta``: each sample's length, parent and own_from.
M_LENGTH, M_PARENT, M_OWN = range(3)


def group_key(sample: Any) -> Hashable:
    """A sample's (``TrainingSequence``) group, the G rollouts of one prompt: its trie when every group has its
    own (``packing.share_across_groups=false``), and the unit the tree planner keeps together either way."""
    return (sample.group_id, sample.prompt_seq)


class PlannedRow(list):
    """A row of samples as the tree planner emitted it: a plain list to every consumer, that also carries the
    placements its trie(s) gave the samples, so the tree packer lays the row out without computing them again
    (a row packs 1.1-1.3x faster without it, ``docs/benchmarks.md``).

    ``parents`` / ``own_from``: int64 [n] in row order (a parent is a row index, -1: none), exactly what inserting
    each trie's samples in row order into a :class:`GroupTrie` gives; ``lengths`` int64 [n]: the samples' lengths
    when planned; ``share_across_groups``: one trie for the row (True) or one per group. Made by the planner only
    when it emits a micro-batch, never mutated afterwards; the packer uses the placements only for the rules they
    were made under and when the row still holds n samples of those lengths (else it computes them).
    """

    __slots__ = ("parents", "own_from", "lengths", "share_across_groups")

    def __init__(
        self,
        samples: list,
        parents: np.ndarray,
        own_from: np.ndarray,
        lengths: np.ndarray,
        share_across_groups: bool,
    ) -> None:
        super().__init__(samples)
        self.parents, self.own_from, self.lengths = parents, own_from, lengths
        self.share_across_groups = share_across_groups

    def __reduce__(self) -> tuple:  # to the other ranks with the placements (a list subclass pickles without)
        return (PlannedRow, (list(self), self.parents, self.own_from, self.lengths, self.share_across_groups))

    def placements_for(
        self, lengths: np.ndarray, share_across_groups: bool
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(parents, own_from) when they describe a row of these ``lengths`` under these rules, else None."""
        if share_across_groups != self.share_across_groups or not np.array_equal(lengths, self.lengths):
            return None
        return self.parents, self.own_from


class Attachment(NamedTuple):
    """Where a new sample goes in a trie, and what it adds.

    ``parent``: the earlier sample whose path it shares below ``own_from`` (-1: none).
    ``own_from``: first depth the sample places itself; its chunk is depths [own_from, length).
    ``new_tokens`` / ``new_pairs``: forwarded tokens and attention pairs (Σ depth + 1) the chunk adds.
    """

    parent: int
    own_from: int
    length: int

    @property
    def new_tokens(self) -> int:
        return self.length - self.own_from

    @property
    def new_pairs(self) -> int:
        n, a = self.length, self.own_from
        return (n * (n + 1) - a * (a + 1)) // 2


# ------------------------------------------------------------------------------------------- compiled kernels
@njit(cache=True, nogil=True)
def new_root(nodes: np.ndarray, counts: np.ndarray) -> int:
    """A new empty trie in the forest (room for one node is the caller's); returns its root node."""
    k = counts[NODES]
    counts[NODES] = k + 1
    nodes[k, START] = 0
    nodes[k, END] = 0
    nodes[k, SRC] = 0
    nodes[k, FIRST] = -1
    nodes[k, CHILD] = -1
    nodes[k, NEXT] = -1
    return k


@njit(cache=True, nogil=True)
def probe(nodes: np.ndarray, store: np.ndarray, root: int, ids: np.ndarray, walk: np.ndarray) -> int:
    """Where ``ids`` (L >= 1) would attach in the trie below ``root``, into ``walk``; the trie is unchanged.
    Returns own_from."""
    length = ids.shape[0]
    node, child, d = root, -1, 0
    while d < length:
        c = nodes[node, CHILD]
        token = ids[d]
        while c != -1 and store[nodes[c, SRC]] != token:
            c = nodes[c, NEXT]
        if c == -1:
            break
        end = nodes[c, END]
        stop = end if end < length else length
        base = nodes[c, SRC] - nodes[c, START]
        k = d + 1
        while k < stop and store[base + k] == ids[k]:
            k += 1
        if k == end:  # the whole edge matched: go down
            node, d = c, k
            continue
        child, d = c, k  # the match stops inside the edge into c (or the sample ends there)
        break
    m = d
    if m == 0:
        parent, own = -1, 0
    elif child != -1:
        parent = nodes[child, FIRST]
        own = length if m == length else m - 1
    else:
        parent = nodes[node, FIRST]
        if m == length:
            own = length
        elif nodes[node, CHILD] != -1:
            own = m - 1
        else:
            own = m
    walk[W_M], walk[W_NODE], walk[W_CHILD], walk[W_PARENT], walk[W_OWN] = m, node, child, parent, own
    return own


@njit(cache=True, nogil=True)
def commit(
    nodes: np.ndarray,
    store: np.ndarray,
    meta: np.ndarray,
    counts: np.ndarray,
    ids: np.ndarray,
    walk: np.ndarray,
) -> int:
    """Add the sample ``walk`` probed (``ids``) as the forest's next sample; room for 2 nodes, its tokens and one
    sample is the caller's. Returns own_from."""
    length = ids.shape[0]
    m, node, child, parent, own = walk[W_M], walk[W_NODE], walk[W_CHILD], walk[W_PARENT], walk[W_OWN]
    j = counts[SAMPLES]
    if m < length:  # a contained sample changes nothing
        if child != -1:  # split the edge into ``child`` at m: ``child`` keeps [start, m), ``low`` the rest
            low = counts[NODES]
            counts[NODES] = low + 1
            start = nodes[child, START]
            nodes[low, START] = m
            nodes[low, END] = nodes[child, END]
            nodes[low, SRC] = nodes[child, SRC] + (m - start)
            nodes[low, FIRST] = nodes[child, FIRST]
            nodes[low, CHILD] = nodes[child, CHILD]
            nodes[low, NEXT] = -1
            nodes[child, END] = m
            nodes[child, CHILD] = low
            node = child
        leaf = counts[NODES]
        counts[NODES] = leaf + 1
        at = counts[STORE]
        store[at : at + length - m] = ids[m:]
        counts[STORE] = at + length - m
        nodes[leaf, START] = m
        nodes[leaf, END] = length
        nodes[leaf, SRC] = at
        nodes[leaf, FIRST] = j
        nodes[leaf, CHILD] = -1
        nodes[leaf, NEXT] = nodes[node, CHILD]
        nodes[node, CHILD] = leaf
    meta[j, M_LENGTH], meta[j, M_PARENT], meta[j, M_OWN] = length, parent, own
    counts[SAMPLES] = j + 1
    counts[TOKENS] += length - own
    counts[PAIRS] += (length * (length + 1) - own * (own + 1)) // 2
    return own


@njit(cache=True, nogil=True)
def _insert_all(
    nodes: np.ndarray,
    store: np.ndarray,
    meta: np.ndarray,
    counts: np.ndarray,
    walk: np.ndarray,
    cat: np.ndarray,
    offsets: np.ndarray,
    trie: np.ndarray,
) -> None:
    """Insert every sample (ids ``cat[offsets[i]:offsets[i + 1]]``) into the trie numbered ``trie[i]`` (0, 1, ...,
    first seen in order), each a new trie of the forest at its first sample."""
    roots = np.full(trie.shape[0], -1, dtype=np.int64)
    for i in range(offsets.shape[0] - 1):
        t = trie[i]
        if roots[t] < 0:
            roots[t] = new_root(nodes, counts)
        ids = cat[offsets[i] : offsets[i + 1]]
        probe(nodes, store, roots[t], ids, walk)
        commit(nodes, store, meta, counts, ids, walk)


# ----------------------------------------------------------------------------------------------- the forest
class Forest:
    """``ranks`` forests of tries (one per row of a micro-batch), as arrays the kernels work on: ``nodes`` int64
    [ranks, cap, 6], ``store`` int64 [ranks, cap], ``meta`` int64 [ranks, cap, 3], ``counts`` int64 [ranks, 5],
    ``walk`` int64 [ranks, 5] (each forest's last probe). :meth:`reserve` grows them (doubling) before a kernel
    adds samples; the kernels never allocate."""

    def __init__(self, ranks: int = 1, nodes: int = 64, store: int = 4096, samples: int = 32) -> None:
        self.nodes = np.zeros((ranks, nodes, 6), dtype=np.int64)
        self.store = np.zeros((ranks, store), dtype=np.int64)
        self.meta = np.zeros((ranks, samples, 3), dtype=np.int64)
        self.counts = np.zeros((ranks, 5), dtype=np.int64)
        self.walk = np.zeros((ranks, 5), dtype=np.int64)

    def clear(self) -> None:
        self.counts[:] = 0

    def reserve(self, samples: int, tokens: int) -> None:
        """Room in every forest for ``samples`` samples in all whose inserts store ``tokens`` tokens in all (and
        their nodes: at most three a sample, a root included). Cheap when there is room already."""
        if 3 * samples >= self.nodes.shape[1]:
            self.nodes = _grown(self.nodes, 3 * samples + 1)
        if tokens > self.store.shape[1]:
            self.store = _grown(self.store, tokens)
        if samples > self.meta.shape[1]:
            self.meta = _grown(self.meta, samples)

    def placements(self, rank: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(parents, own_from, lengths) int64 [n] of forest ``rank``'s samples, in insertion order (copies)."""
        meta = self.meta[rank, : self.counts[rank, SAMPLES]]
        return meta[:, M_PARENT].copy(), meta[:, M_OWN].copy(), meta[:, M_LENGTH].copy()


def _grown(array: np.ndarray, need: int) -> np.ndarray:
    """``array`` with at least ``need`` entries along axis 1, doubling (contents kept)."""
    have = array.shape[1]
    if need <= have:
        return array
    shape = list(array.shape)
    shape[1] = max(need, 2 * have)
    out = np.zeros(shape, dtype=array.dtype)
    out[:, :have] = array
    return out


def placements(cat: np.ndarray, offsets: np.ndarray, trie: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(parent, own_from) int64 [n] of a row's samples (ids ``cat[offsets[i]:offsets[i + 1]]``, each non-empty),
    exactly as inserting each trie's samples in row order into a :class:`GroupTrie` gives them; ``trie`` int64
    [n]: each sample's trie, numbered 0, 1, ... A parent is a row index (-1: none)."""
    n = offsets.shape[0] - 1
    forest = Forest(1, nodes=3 * n + 1, store=int(offsets[-1]) + 1, samples=n)
    _insert_all(
        forest.nodes[0], forest.store[0], forest.meta[0], forest.counts[0], forest.walk[0], cat, offsets, trie
    )
    parents, own_from, _ = forest.placements()
    return parents, own_from


class GroupTrie:
    """One trie, a sample at a time (``bench trainer``'s synthetic rows, tests): :meth:`probe` where a sample
    would attach, :meth:`commit` it, or :meth:`insert` both. ``parents`` / ``own_from`` / ``lengths``: lists in
    insertion order; ``num_tokens`` / ``num_pairs``: what the trie forwards. Each call is one compiled call
    (~1 us): code that inserts many samples uses :func:`placements` or the planner."""

    def __init__(self) -> None:
        self._forest = Forest(1)
        self._root = new_root(self._forest.nodes[0], self._forest.counts[0])
        self._probed: tuple[np.ndarray, Attachment] | None = None

    def __len__(self) -> int:
        return int(self._forest.counts[0, SAMPLES])

    def probe(self, ids: Any) -> Attachment:
        """Where ``ids`` (int64 [L], L >= 1) would attach; the trie is unchanged."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if ids.ndim != 1 or ids.shape[0] == 0:
            raise ValueError(f"a trie sample must be a non-empty 1-D id array, got shape {ids.shape}")
        f = self._forest
        own = probe(f.nodes[0], f.store[0], self._root, ids, f.walk[0])
        att = Attachment(int(f.walk[0, W_PARENT]), int(own), int(ids.shape[0]))
        self._probed = (ids, att)
        return att

    def commit(self) -> Attachment:
        """Add the sample of the last :meth:`probe` (as it probed); returns its attachment."""
        if self._probed is None:
            raise RuntimeError("GroupTrie.commit without a probe")
        (ids, att), self._probed = self._probed, None
        f = self._forest
        f.reserve(len(self) + 1, int(f.counts[0, STORE]) + ids.shape[0])
        commit(f.nodes[0], f.store[0], f.meta[0], f.counts[0], ids, f.walk[0])
        return att

    def insert(self, ids: Any) -> Attachment:
        """Probe and commit ``ids``; returns its attachment."""
        self.probe(ids)
        return self.commit()

    @property
    def parents(self) -> list[int]:
        return self._forest.placements()[0].tolist()

    @property
    def own_from(self) -> list[int]:
        return self._forest.placements()[1].tolist()

    @property
    def lengths(self) -> list[int]:
        return self._forest.placements()[2].tolist()

    @property
    def num_tokens(self) -> int:
        return int(self._forest.counts[0, TOKENS])

    @property
    def num_pairs(self) -> int:
        return int(self._forest.counts[0, PAIRS])

    def anchor(self, j: int) -> tuple[int, int]:
        """(chunk, depth) of the placement sample j's chunk hangs below; (-1, -1) for a root chunk. The chunk is
        the sample that placed depth ``own_from[j] - 1`` on j's path: up j's parents until one places it."""
        parents, own_from, _ = self._forest.placements()
        a = int(own_from[j]) - 1
        if a < 0:
            return -1, -1
        p = int(parents[j])
        while a < own_from[p]:
            p = int(parents[p])
        return p, a
