"""One group's prefix trie, kept as per-sample arrays: shared by the tree packer and the tree planner.

Imports numpy only (no torch), so the planner can run on plain data.

Placements. A trie node is a distinct token-id prefix. A node is forwarded once per *placement*: a node with
c >= 2 children (distinct next tokens) is placed c times, once at the head of each child's branch; any other
node is placed once. This is the duplication of the reference's worked example: a position predicts one next
token, so ``p3`` followed by ``a1`` in one rollout and by ``b1`` in another is forwarded twice. A sample that
ends on a node (a prefix of another sample, or an identical sample) predicts nothing from it and reuses an
existing placement. Forwarded tokens of a group = Σ_nodes max(1, children); attention pairs = Σ over placements
of (depth + 1), since a placement sees exactly its root-to-node path.

Samples are inserted in order. Sample j compares against the earlier samples by their longest common prefix
(numpy, one comparison over a padded [n, width] id matrix); with ``m`` the longest, ``i*`` the earliest sample
reaching it and ``L`` the sample's length:

    m == 0                        a new root: j places depths [0, L)
    m == L                        contained (prefix of / equal to i*): j places nothing, its path is i*'s
    0 < m < L, node m-1 has a     node m-1 branches: j places depths [m-1, L) (its own copy of the last
      child already              shared token), hanging below i*'s placement at depth m-2 (a root if m == 1)
    0 < m < L, otherwise          every earlier sample through node m-1 ends there: j extends that leaf,
                                  placing depths [m, L) below i*'s placement at depth m-1

``owner[j][d]`` names the sample whose chunk holds the placement sample j uses at depth d, so a layout that
gives each chunk a start position maps every sample token to its packed position with one array expression.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

PAD = -1  # token ids are non-negative, so padding never matches


def group_key(sample: Any) -> Hashable:
    """The trie a sample (``TrainingSequence``) belongs to: its group, the G rollouts of one prompt."""
    return (sample.group_id, sample.prompt_seq)


@dataclass(frozen=True)
class Attachment:
    """Where a new sample goes in a group trie, and what it adds.

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


class GroupTrie:
    """The samples of one group in insertion order, with their placements (see the module docstring)."""

    def __init__(self) -> None:
        self._ids = np.full((4, 64), PAD, dtype=np.int64)
        self.lengths: list[int] = []
        self.parents: list[int] = []
        self.own_from: list[int] = []
        self.owners: list[np.ndarray] = []
        self.num_tokens = 0
        self.num_pairs = 0

    def __len__(self) -> int:
        return len(self.lengths)

    def probe(self, ids: np.ndarray) -> Attachment:
        """Where ``ids`` (int64 [L], L >= 1, non-negative) would attach; the trie is unchanged."""
        length = int(ids.shape[0])
        n = len(self.lengths)
        if n == 0:
            return Attachment(parent=-1, own_from=0, length=length)
        w = min(length, self._ids.shape[1])
        eq = self._ids[:n, :w] == ids[:w]
        lcp = np.where(eq.all(axis=1), w, eq.argmin(axis=1))
        best = int(lcp.argmax())  # earliest among the longest
        m = int(lcp[best])
        if m == 0:
            return Attachment(parent=-1, own_from=0, length=length)
        if m == length:
            return Attachment(parent=best, own_from=length, length=length)
        lengths = np.asarray(self.lengths)
        has_child = bool(((lcp == m) & (lengths > m)).any())
        return Attachment(parent=best, own_from=m - 1 if has_child else m, length=length)

    def insert(self, ids: np.ndarray, att: Attachment | None = None) -> Attachment:
        """Add ``ids`` (as placed by ``att``, probed now when None); returns its attachment."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or ids.shape[0] == 0:
            raise ValueError(f"a trie sample must be a non-empty 1-D id array, got shape {ids.shape}")
        if att is None:
            att = self.probe(ids)
        j, length = len(self.lengths), att.length
        rows, width = self._ids.shape
        if j == rows or length > width:
            grown = np.full((2 * rows if j == rows else rows, max(width, length)), PAD, dtype=np.int64)
            grown[:rows, :width] = self._ids
            self._ids = grown
        self._ids[j, :length] = ids
        own = np.full(length - att.own_from, j, dtype=np.int32)
        inherited = self.owners[att.parent][: att.own_from] if att.parent >= 0 else own[:0]
        self.owners.append(np.concatenate([inherited, own]))
        self.lengths.append(length)
        self.parents.append(att.parent)
        self.own_from.append(att.own_from)
        self.num_tokens += att.new_tokens
        self.num_pairs += att.new_pairs
        return att

    def anchor(self, j: int) -> tuple[int, int]:
        """(chunk, depth) of the placement sample j's chunk hangs below; (-1, -1) for a root chunk."""
        a = self.own_from[j] - 1
        if a < 0:
            return -1, -1
        return int(self.owners[self.parents[j]][a]), a
