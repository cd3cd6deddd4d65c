"""Tree packing: one row forwards each shared prefix once, and every sample still sees only itself.

Layout rules (reference section i; the trie and its placements are described in ``packing/trie.py``):
  - one prefix trie per row over exact token ids (``packing.share_across_groups``, the default): samples of
    different groups whose prompts share a prefix (a system prompt, few-shot examples, a chat template's
    opening) share its placements exactly as the rollouts of one group share their prompt; with
    ``share_across_groups=false``, one trie per group (``(group_id, prompt_seq)``) and groups never share.
    Sharing is exact because a token's hidden state depends only on its root-to-token path (its own ids at its
    own positions), which a shared placement has for every sample through it, whatever their groups;
  - the roots (first tokens) are laid out group by group, in the order the groups first appear in the row (a
    root's group: that of the sample placing it), then in row order: a row whose groups share no first token
    is laid out exactly as with one trie per group;
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

Everything is array operations over the whole row (no per-sample numpy call, no per-token Python loop;
``packing/tree_arrays.py``) and nothing is O(T²): the row carries the DFS intervals (``leave``), rendered as a
mask only for the model's kernel (``model/logprobs.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.packing.attention import token_leave
from asyncgrpo_cli.packing.row import PackedRow, gather_loss_terms
from asyncgrpo_cli.packing.tree_arrays import owners, path_pieces, preorder
from asyncgrpo_cli.packing.trie import PlannedRow, group_key, placements
from asyncgrpo_cli.samples import TrainingSequence


@dataclass
class TreeLayout:
    """A row's forward layout, as numpy arrays (T forwarded tokens, S segments, n samples).

    ``input_ids`` / ``position_ids`` int64 [T]; ``segment_offsets`` int64 [S + 1] and ``segment_parents`` int64
    [S] (pre-order forest, see ``packing/attention.py``); ``leave`` int64 [T] (DFS interval end of each key);
    ``sample_offsets`` int64 [n + 1]: sample ``s`` is flat tokens [sample_offsets[s], sample_offsets[s + 1]) of
    the samples laid one after another, whose ids are ``flat_ids`` int64 [Σ L]. Where each flat token sits in
    the row is kept as path pieces (``piece_start`` / ``piece_shift``, see ``tree_arrays.path_pieces``):
    :meth:`locate` maps any flat tokens, :attr:`positions` all of them.
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    segment_offsets: np.ndarray
    segment_parents: np.ndarray
    leave: np.ndarray
    sample_offsets: np.ndarray
    flat_ids: np.ndarray
    piece_start: np.ndarray
    piece_shift: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def locate(self, flat: np.ndarray) -> np.ndarray:
        """int64: the packed position of each flat token index in ``flat``."""
        return flat + self.piece_shift[np.searchsorted(self.piece_start, flat, side="right") - 1]

    @property
    def positions(self) -> np.ndarray:
        """int64 [Σ L]: the packed position of every token of every sample (its root-to-leaf path)."""
        total = int(self.sample_offsets[-1])
        sizes = np.diff(np.append(self.piece_start, total))
        return np.arange(total) + np.repeat(self.piece_shift, sizes)

    @property
    def multiplicity(self) -> np.ndarray:
        """int64 [T]: how many samples have each packed position on their path (``PackedRow.multiplicity``).

        A sample's path is its last token's root-to-token path, and position ``p``'s subtree is the DFS interval
        ``[p, leave[p])``, so the count is the number of samples whose last token lies in it: with ``below[x]``
        the number of last tokens before position x (a cumulative count), ``below[leave[p]] - below[p]`` (O(T + n),
        not O(Σ L)).
        """
        last = self.locate(self.sample_offsets[1:] - 1)
        below = np.zeros(self.num_tokens + 1, dtype=np.int64)
        np.cumsum(np.bincount(last, minlength=self.num_tokens), out=below[1:])
        return below[self.leave] - below[:-1]

    @property
    def sample_positions(self) -> list[np.ndarray]:
        """``positions`` split per sample."""
        return np.split(self.positions, self.sample_offsets[1:-1])


def _check_ids(samples: Sequence[TrainingSequence]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """(ids, lengths, concatenated int64 ids) of the row; ValueError naming the first sample that is not a
    non-empty 1-D array of ids >= 0."""
    ids = [x if isinstance(x := s.input_ids, np.ndarray) else np.asarray(x, dtype=np.int64) for s in samples]
    lengths = np.fromiter((x.shape[0] if x.ndim == 1 else 0 for x in ids), dtype=np.int64, count=len(ids))
    bad = np.flatnonzero(lengths == 0)
    scan = ids[: int(bad[0])] if bad.size else ids
    cat = np.concatenate(scan).astype(np.int64, copy=False) if scan else np.zeros(0, np.int64)
    first = int(bad[0]) if bad.size else -1
    if cat.size and int(cat.min()) < 0:
        first = int(np.searchsorted(np.cumsum(lengths[: len(scan)]), int(np.argmax(cat < 0)), side="right"))
    if first >= 0:
        raise ValueError(
            f"sample {first}: input_ids must be a non-empty 1-D array of ids >= 0 (shape {ids[first].shape})"
        )
    return ids, lengths, cat


def tree_layout(samples: Sequence[TrainingSequence], share_across_groups: bool = True) -> TreeLayout:
    """The :class:`TreeLayout` of one row's samples (at least one, each non-empty; token ids >= 0): one trie per
    row (``share_across_groups``) or per group. A :class:`~asyncgrpo_cli.packing.trie.PlannedRow` (a row as the
    tree planner emitted it) brings its samples' placements under those rules; for any other sequence they are
    computed here, to the same values.

    Array operations over the whole row (``packing/tree_arrays.py``): each sample's placement (parent sample and
    first own depth), its chunk's anchor, the depth-first order of the chunks, then every token's packed position
    by gathers over cumulative sums. A row's trie is placed as one sub-trie per distinct first token (samples
    with different first tokens share nothing), so a row without cross-group sharing costs what it did.
    """
    if not samples:
        raise ValueError("cannot pack an empty row: the planner gives every rank at least one sample")
    ids, lengths, cat = _check_ids(samples)
    n = len(ids)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    first: dict[Hashable, int] = {}
    group = np.array([first.setdefault(group_key(s), len(first)) for s in samples], dtype=np.int64)
    placed = samples.placements_for(lengths, share_across_groups) if isinstance(samples, PlannedRow) else None
    if placed is not None:
        parent, own_from = placed
    else:
        offsets = np.concatenate([[0], ends]).astype(np.int64)
        parent, own_from = placements(cat, offsets, np.zeros(n, np.int64) if share_across_groups else group)
    chunks = np.flatnonzero(own_from < lengths)  # samples that place tokens, ascending
    a = own_from[chunks] - 1  # the depth each chunk hangs below (-1: a root)
    hung = np.flatnonzero(a >= 0)
    anchor_sample = np.full(chunks.shape[0], -1, dtype=np.int64)
    anchor_sample[hung] = owners(parent, own_from, parent[chunks[hung]], a[hung])
    chunk_index = np.full(n, -1, dtype=np.int64)
    chunk_index[chunks] = np.arange(chunks.shape[0])
    anchor = np.where(anchor_sample >= 0, chunk_index[np.maximum(anchor_sample, 0)], -1)
    order = preorder(anchor, np.maximum(a, 0), group[chunks])
    placed = chunks[order]
    sizes = lengths[placed] - own_from[placed]
    chunk_ends = np.cumsum(sizes)
    total = int(chunk_ends[-1])
    chunk_start = np.zeros(n, dtype=np.int64)
    chunk_start[placed] = chunk_ends - sizes
    step = np.arange(total) - np.repeat(chunk_ends - sizes, sizes)  # index within the chunk
    depth = np.repeat(own_from[placed], sizes) + step
    input_ids = cat[np.repeat(starts[placed], sizes) + depth]
    parent_pos = np.arange(-1, total - 1, dtype=np.int64)
    head_anchor, head_a = anchor_sample[order], a[order]
    parent_pos[chunk_start[placed]] = np.where(
        head_anchor >= 0,
        chunk_start[np.maximum(head_anchor, 0)] + head_a - own_from[np.maximum(head_anchor, 0)],
        -1,
    )
    piece_start, piece_shift = path_pieces(parent, own_from, lengths, chunk_start)
    offsets, seg_parents = _segments(parent_pos)
    return TreeLayout(
        input_ids=input_ids,
        position_ids=depth,
        segment_offsets=offsets,
        segment_parents=seg_parents,
        leave=token_leave(offsets, seg_parents),
        sample_offsets=np.concatenate([[0], ends]).astype(np.int64),
        flat_ids=cat,
        piece_start=piece_start,
        piece_shift=piece_shift,
    )


def _segments(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, parents) of the segments of a pre-order row with token parents ``parent``: a segment starts at a
    root, at a token not hanging below its left neighbour, and after a fork."""
    total = parent.shape[0]
    num_children = np.bincount(parent[parent >= 0], minlength=total)
    new_segment = parent != np.arange(-1, total - 1)
    new_segment[1:] |= num_children[:-1] >= 2
    new_segment[0] = True
    seg_starts = np.flatnonzero(new_segment)
    seg_id = np.cumsum(new_segment) - 1
    head_parent = parent[seg_starts]
    seg_parents = np.where(head_parent >= 0, seg_id[np.maximum(head_parent, 0)], -1)
    return np.append(seg_starts, total).astype(np.int64), seg_parents.astype(np.int64)


@dataclass
class TreeRow(PackedRow):
    """A :class:`PackedRow` that also carries its segment tree: ``segment_offsets`` int64 [S + 1] and
    ``segment_parents`` int64 [S] as in :class:`TreeLayout` (``leave`` is a :class:`PackedRow` field)."""

    segment_offsets: torch.Tensor
    segment_parents: torch.Tensor


class TreePacker:
    """Packs one row's samples as one prefix trie (``packing.share_across_groups``) or one per group; see the
    module docstring for the layout. ``planner``: the planner counting the same tries."""

    def __init__(self, cfg: PackingConfig) -> None:
        self.cfg = cfg
        self.share_across_groups = cfg.share_across_groups
        self.planner = "asyncgrpo_cli.packing.tree_planner:" + (
            "TreeBudgetPlanner" if self.share_across_groups else "GroupTreeBudgetPlanner"
        )

    def pack(self, samples: Sequence[TrainingSequence]) -> TreeRow:
        """The packed row of ``samples`` (at least one, each non-empty)."""
        layout = tree_layout(samples, self.share_across_groups)
        terms = gather_loss_terms(samples, layout.locate, layout.flat_ids)
        return TreeRow(
            input_ids=torch.from_numpy(layout.input_ids)[None],
            position_ids=torch.from_numpy(layout.position_ids)[None],
            leave=torch.from_numpy(layout.leave),
            multiplicity=torch.from_numpy(layout.multiplicity),
            **terms,
            num_forwarded=layout.num_tokens,
            num_trained=int(terms["target_ids"].shape[0]),
            num_samples=len(samples),
            num_unpacked=int(layout.sample_offsets[-1]),
            segment_offsets=torch.from_numpy(layout.segment_offsets),
            segment_parents=torch.from_numpy(layout.segment_parents),
        )
