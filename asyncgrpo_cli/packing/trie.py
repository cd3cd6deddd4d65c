"""A prefix trie of samples: what a sample adds to a tree-packed row, for the tree planner (and ``bench trainer``).

A tree-packed row holds one trie over all of its samples (``packing.share_across_groups``, the default), so groups
whose prompts share a prefix share it, or one trie per group (:func:`group_key`). The rules below are the same
either way: a trie does not know which group a sample came from.

Imports numpy only (no torch), so the planner can run on plain data. The tree packer lays rows out from the same
rules with array operations over the whole row (``packing/tree.py``); tests check both against each other.

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

How ``m``, ``i*`` and "node m-1 has a child" are found: the trie is kept compressed (a radix tree). An edge
holds the token ids of a run of depths as ``bytes`` (8 per token) and its lower node the earliest sample below
it. A probe walks from the root: one dict lookup on the next token, one ``startswith`` (a memcmp) per whole edge,
and at most one XOR of two big integers to find where a partially matched edge parts. The match ends at depth
``m``; ``i*`` is the earliest sample below that point (every sample there shares the first ``m`` tokens and no
other does); node m-1 has a child iff the match stopped inside an edge or at a node with outgoing edges. So a
probe costs a few Python operations per trie level on the sample's path, not an array operation per earlier
sample.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np


def group_key(sample: Any) -> Hashable:
    """A sample's (``TrainingSequence``) group, the G rollouts of one prompt: its trie when every group has its
    own (``packing.share_across_groups=false``), and the unit the tree planner keeps together either way."""
    return (sample.group_id, sample.prompt_seq)


def trie_key(ids: Any) -> bytes:
    """The bytes a trie compares: the ids as native int64, 8 bytes per token."""
    return np.asarray(ids, dtype=np.int64).tobytes()


class PlannedRow(list):
    """A row of samples as the tree planner emitted it: a plain list to every consumer, that also carries the
    placements its trie(s) gave the samples, so the tree packer lays the row out without computing them again
    (``tree_arrays.placements``; a row packs 1.1-1.3x faster without it, ``docs/benchmarks.md``).

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
    """Where a new sample goes in a trie, and what it adds (a named tuple: built once per probe, and a
    frozen dataclass costs ~1 us to build).

    ``parent``: the earlier sample (group-local index) whose path it shares below ``own_from`` (-1: none).
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


class _Node:
    """The lower end of an edge covering depths [start, end) with token bytes ``label``; ``first``: the earliest
    sample whose path runs through it."""

    __slots__ = ("children", "start", "end", "label", "first")

    def __init__(self, start: int, end: int, label: bytes, first: int) -> None:
        self.children: dict[bytes, _Node] = {}
        self.start, self.end, self.label, self.first = start, end, label, first


def _common(key: bytes, at: int, label: bytes, n: int) -> int:
    """How many of the first ``n`` tokens of ``key[at:]`` and ``label`` are equal."""
    x = int.from_bytes(key[at : at + 8 * n], "big") ^ int.from_bytes(label[: 8 * n], "big")
    return n if x == 0 else (64 * n - x.bit_length()) // 64


class GroupTrie:
    """The samples of one trie (a row's or a group's) in insertion order, with their placements (see the module
    docstring)."""

    def __init__(self) -> None:
        self._root = _Node(0, 0, b"", -1)
        self.lengths: list[int] = []
        self.parents: list[int] = []
        self.own_from: list[int] = []
        self.num_tokens = 0
        self.num_pairs = 0
        self._walk: tuple[Attachment, bytes, _Node, _Node | None, int] | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def probe(self, ids: np.ndarray, key: bytes | None = None) -> Attachment:
        """Where ``ids`` (int64 [L], L >= 1) would attach; the trie is unchanged. ``key``: ``trie_key(ids)``, when
        the caller already has it."""
        key = trie_key(ids) if key is None else key
        length = len(key) // 8
        node, child, d = self._root, None, 0
        while d < length:
            child = node.children.get(key[8 * d : 8 * d + 8])
            if child is None:
                break
            if child.end <= length and key.startswith(child.label, 8 * d):
                node, child, d = child, None, child.end
                continue
            d += _common(key, 8 * d, child.label, min(child.end, length) - d)
            break
        m = d
        if m == 0:
            att = Attachment(parent=-1, own_from=0, length=length)
        elif child is not None:  # the match stops inside the edge into ``child``: it continues below m
            att = Attachment(child.first, length if m == length else m - 1, length)
        else:  # the match stops at ``node``
            own = length if m == length else (m - 1 if node.children else m)
            att = Attachment(node.first, own, length)
        self._walk = (att, key, node, child, m)
        return att

    def insert(self, ids: np.ndarray, att: Attachment | None = None, key: bytes | None = None) -> Attachment:
        """Add ``ids`` (as placed by ``att``, probed now when None or not this trie's last probe); returns its
        attachment."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or ids.shape[0] == 0:
            raise ValueError(f"a trie sample must be a non-empty 1-D id array, got shape {ids.shape}")
        walk = self._walk
        if att is None or walk is None or walk[0] is not att:
            self.probe(ids, key)
        return self.commit()

    def commit(self) -> Attachment:
        """Add the sample of the last :meth:`probe` (as it probed); returns its attachment."""
        walk = self._walk
        if walk is None:
            raise RuntimeError("GroupTrie.commit without a probe")
        att, key, node, child, m = walk
        self._walk = None
        length, own = att.length, att.own_from
        if m < length:  # contained samples change nothing
            if child is not None:  # split the edge into ``child`` at depth m
                cut = 8 * (m - child.start)
                mid = _Node(child.start, m, child.label[:cut], child.first)
                node.children[child.label[:8]] = mid
                child.label, child.start = child.label[cut:], m
                mid.children[child.label[:8]] = child
                node = mid
            node.children[key[8 * m : 8 * m + 8]] = _Node(m, length, key[8 * m :], len(self.lengths))
        self.lengths.append(length)
        self.parents.append(att.parent)
        self.own_from.append(own)
        self.num_tokens += length - own
        self.num_pairs += (length * (length + 1) - own * (own + 1)) // 2
        return att

    def anchor(self, j: int) -> tuple[int, int]:
        """(chunk, depth) of the placement sample j's chunk hangs below; (-1, -1) for a root chunk. The chunk is
        the sample that placed depth ``own_from[j] - 1`` on j's path: up j's parents until one places it."""
        a = self.own_from[j] - 1
        if a < 0:
            return -1, -1
        p = self.parents[j]
        while a < self.own_from[p]:
            p = self.parents[p]
        return p, a
