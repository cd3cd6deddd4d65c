"""Tree packing: one row forwards each group's shared prefixes once, and every sample still sees only itself.

Layout rules (reference section i; the trie and its placements are described in ``packing/trie.py``):
  - one prefix trie per group (``(group_id, prompt_seq)``), over exact token ids; groups never share tokens
    and are laid out one after another in the order they first appear in the row;
  - a node with several children is duplicated into each branch (the last shared token heads every branch);
  - depth-first (pre-order) layout; at a fork the branch of the earliest sample comes first;
  - unbranched chains collapse into *segments*: a segment ends where a placement has >= 2 children or none;
  - ``position_ids`` = depth = the token's index in its own sample, so RoPE is unchanged;
  - attention: each token sees its root-to-token path (``packing/attention.py``: DFS intervals);
  - loss terms: the explicit (predecessor position, target) gather of :func:`gather_loss_terms`; identical
    samples and samples that are prefixes of others make one position predict several targets.

Worked example (``r0 = p1 p2 p3 a1 a2``, ``r1 = p1 p2 p3 b1 b2``)::

    index         0  1  2  3  4  5  6  7
    input_ids     p1 p2 p3 a1 a2 p3 b1 b2
    position_ids  0  1  2  3  4  2  3  4
    segment       S0 S0 S1 S1 S1 S2 S2 S2      S1 and S2 hang below S0
    r0 predicted at 2, 3 (a1, a2); r1 at 5, 6 (b1, b2); 8 forwarded tokens instead of 10

Everything is per-sample numpy (no per-token Python loop) and nothing is O(T²): the row carries the DFS intervals
(``leave``), rendered as a mask only for the model's kernel (``model/logprobs.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.samples import TrainingSequence
from tests.helpers.packing_reference.attention import token_leave
from tests.helpers.packing_reference.row import PackedRow, gather_loss_terms
from tests.helpers.packing_reference.trie import GroupTrie, group_key


@dataclass
class TreeLayout:
    """A row's forward layout, as numpy arrays (T forwarded tokens, S segments).

    ``input_ids`` / ``position_ids`` int64 [T]; ``segment_offsets`` int64 [S + 1] and ``segment_parents`` int64
    [S] (pre-order forest, see ``packing/attention.py``); ``leave`` int64 [T] (DFS interval end of each key);
    ``sample_positions[s]`` int64 [L_s]: packed position of each token of sample ``s`` (its root-to-leaf path).
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    segment_offsets: np.ndarray
    segment_parents: np.ndarray
    leave: np.ndarray
    sample_positions: list[np.ndarray]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class _GroupLayout:
    ids: list[np.ndarray]  # per placed chunk, in layout order
    depths: list[np.ndarray]
    parent_pos: np.ndarray  # [T_g] packed parent placement (group-local), -1 for roots
    positions: list[np.ndarray]  # per group sample, group-local


def _layout_group(samples: Sequence[np.ndarray]) -> _GroupLayout:
    """Insert one group's samples into a trie and lay its chunks out depth-first (group-local positions)."""
    trie = GroupTrie()
    for ids in samples:
        trie.insert(ids)
    own_from = np.asarray(trie.own_from, dtype=np.int64)
    lengths = np.asarray(trie.lengths, dtype=np.int64)
    placed = np.flatnonzero(own_from < lengths)
    children: dict[int, list[tuple[int, int]]] = {}
    roots: list[int] = []
    anchors: dict[int, tuple[int, int]] = {}
    for j in placed.tolist():
        c, a = trie.anchor(j)
        anchors[j] = (c, a)
        if c < 0:
            roots.append(j)
        else:
            children.setdefault(c, []).append((-a, j))  # deepest anchor first, then earliest sample
    order: list[int] = []
    stack = roots[::-1]
    while stack:
        c = stack.pop()
        order.append(c)
        stack.extend(j for _, j in sorted(children.get(c, ()), reverse=True))
    sizes = lengths[order] - own_from[order]
    starts = np.zeros(lengths.shape[0], dtype=np.int64)
    starts[order] = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    parent_pos = np.arange(-1, int(sizes.sum()) - 1, dtype=np.int64)
    for c in order:
        anchor_chunk, depth = anchors[c]
        parent_pos[starts[c]] = (
            -1 if anchor_chunk < 0 else starts[anchor_chunk] + depth - own_from[anchor_chunk]
        )
    positions = [starts[o] + np.arange(o.shape[0]) - own_from[o] for o in trie.owners]
    return _GroupLayout(
        ids=[samples[c][own_from[c] :] for c in order],
        depths=[np.arange(own_from[c], lengths[c]) for c in order],
        parent_pos=parent_pos,
        positions=positions,
    )


def tree_layout(samples: Sequence[TrainingSequence]) -> TreeLayout:
    """The :class:`TreeLayout` of one row's samples (at least one, each non-empty; token ids >= 0)."""
    if not samples:
        raise ValueError("cannot pack an empty row: the planner gives every rank at least one sample")
    ids = [np.asarray(s.input_ids, dtype=np.int64) for s in samples]
    for i, x in enumerate(ids):
        if x.ndim != 1 or x.shape[0] == 0 or int(x.min()) < 0:
            raise ValueError(
                f"sample {i}: input_ids must be a non-empty 1-D array of ids >= 0 (shape {x.shape})"
            )
    groups: dict[Hashable, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(group_key(s), []).append(i)
    parts_ids, parts_depth, parts_parent = [], [], []
    sample_positions: list[np.ndarray] = [np.empty(0, np.int64)] * len(samples)
    offset = 0
    for members in groups.values():
        g = _layout_group([ids[i] for i in members])
        parts_ids += g.ids
        parts_depth += g.depths
        parts_parent.append(np.where(g.parent_pos >= 0, g.parent_pos + offset, -1))
        for i, pos in zip(members, g.positions, strict=True):
            sample_positions[i] = pos + offset
        offset += g.parent_pos.shape[0]
    # A segment starts at a root, at a token not hanging below its left neighbour, and after a fork.
    parent = np.concatenate(parts_parent)
    total = parent.shape[0]
    num_children = np.bincount(parent[parent >= 0], minlength=total)
    new_segment = parent != np.arange(-1, total - 1)
    new_segment[1:] |= num_children[:-1] >= 2
    new_segment[0] = True
    seg_starts = np.flatnonzero(new_segment)
    seg_id = np.cumsum(new_segment) - 1
    head_parent = parent[seg_starts]
    seg_parents = np.where(head_parent >= 0, seg_id[np.maximum(head_parent, 0)], -1)
    offsets = np.append(seg_starts, total).astype(np.int64)
    return TreeLayout(
        input_ids=np.concatenate(parts_ids),
        position_ids=np.concatenate(parts_depth).astype(np.int64),
        segment_offsets=offsets,
        segment_parents=seg_parents.astype(np.int64),
        leave=token_leave(offsets, seg_parents),
        sample_positions=sample_positions,
    )


@dataclass
class TreeRow(PackedRow):
    """A :class:`PackedRow` that also carries its segment tree: ``segment_offsets`` int64 [S + 1] and
    ``segment_parents`` int64 [S] as in :class:`TreeLayout` (``leave`` is a :class:`PackedRow` field)."""

    segment_offsets: torch.Tensor
    segment_parents: torch.Tensor


class TreePacker:
    """Packs one row's samples as per-group prefix tries; see the module docstring for the layout."""

    planner = "asyncgrpo_cli.packing.tree_planner:TreeBudgetPlanner"

    def __init__(self, cfg: PackingConfig) -> None:
        self.cfg = cfg

    def pack(self, samples: Sequence[TrainingSequence]) -> TreeRow:
        """The packed row of ``samples`` (at least one, each non-empty)."""
        layout = tree_layout(samples)
        terms = gather_loss_terms(samples, layout.sample_positions)
        return TreeRow(
            input_ids=torch.from_numpy(layout.input_ids)[None],
            position_ids=torch.from_numpy(layout.position_ids)[None],
            leave=torch.from_numpy(layout.leave),
            multiplicity=torch.from_numpy(  # every sample's path, counted position by position
                np.bincount(np.concatenate(layout.sample_positions), minlength=layout.num_tokens)
            ),
            **terms,
            num_forwarded=layout.num_tokens,
            num_trained=int(terms["target_ids"].shape[0]),
            num_samples=len(samples),
            num_unpacked=sum(len(s) for s in samples),
            segment_offsets=torch.from_numpy(layout.segment_offsets),
            segment_parents=torch.from_numpy(layout.segment_parents),
        )
