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

The layout is a few compiled passes over the row's chunks and tokens (``packing/tree_arrays.py``), after one
concatenation of the samples' ids and masks; nothing is O(T²): the row carries the DFS intervals (``leave``),
rendered as a mask only for the model's kernel (``model/logprobs.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.packing import tree_arrays
from asyncgrpo_cli.packing.row import PackedRow, loss_terms, row_arrays, untrainable_first_token
from asyncgrpo_cli.packing.trie import PlannedRow, group_key, placements
from asyncgrpo_cli.samples import TrainingSequence


@dataclass
class TreeLayout:
    """A row's forward layout, as numpy arrays (T forwarded tokens, S segments, n samples).

    ``input_ids`` / ``position_ids`` int64 [T]; ``segment_offsets`` int64 [S + 1] and ``segment_parents`` int64
    [S] (pre-order forest, see ``packing/attention.py``); ``leave`` int64 [T] (DFS interval end of each key);
    ``multiplicity`` int64 [T] (``PackedRow.multiplicity``); ``sample_offsets`` int64 [n + 1]: sample ``s`` is
    flat tokens [sample_offsets[s], sample_offsets[s + 1]) of the samples laid one after another, whose ids are
    ``flat_ids`` int64 [Σ L]; ``parent`` / ``own_from`` int64 [n]: the samples' placements, ``chunk_start`` int64
    [n] where each sample's chunk starts (-1: none), from which :attr:`positions` follow.
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    segment_offsets: np.ndarray
    segment_parents: np.ndarray
    leave: np.ndarray
    multiplicity: np.ndarray
    sample_offsets: np.ndarray
    flat_ids: np.ndarray
    parent: np.ndarray
    own_from: np.ndarray
    chunk_start: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def positions(self) -> np.ndarray:
        """int64 [Σ L]: the packed position of every token of every sample (its root-to-leaf path)."""
        return tree_arrays.positions(self.sample_offsets, self.parent, self.own_from, self.chunk_start)

    @property
    def sample_positions(self) -> list[np.ndarray]:
        """``positions`` split per sample."""
        return np.split(self.positions, self.sample_offsets[1:-1])


def _check_ids(samples: Sequence[TrainingSequence]) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, concatenated int64 ids) of the row; ValueError naming the first sample that is not a non-empty
    1-D array of ids >= 0."""
    ids = [s.input_ids for s in samples]
    try:  # the usual row: 1-D arrays of ids >= 0 (checked on the concatenation), else name the first bad one
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        cat = np.concatenate(ids)
        if cat.ndim == 1 and int(lengths.min()) > 0 and (not cat.size or int(cat.min()) >= 0):
            return lengths, cat.astype(np.int64, copy=False)
    except (TypeError, ValueError):
        pass
    ids = [x if isinstance(x, np.ndarray) else np.asarray(x, dtype=np.int64) for x in ids]
    lengths = np.fromiter((x.shape[0] if x.ndim == 1 else 0 for x in ids), dtype=np.int64, count=len(ids))
    bad = np.flatnonzero(lengths == 0)
    scan = ids[: int(bad[0])] if bad.size else ids
    cat = np.concatenate(scan).astype(np.int64, copy=False) if scan else np.zeros(0, np.int64)
    first = int(bad[0]) if bad.size else -1
    if cat.size and int(cat.min()) < 0:
        first = int(np.searchsorted(np.cumsum(lengths[: len(scan)]), int(np.argmax(cat < 0)), side="right"))
    raise ValueError(
        f"sample {first}: input_ids must be a non-empty 1-D array of ids >= 0 (shape {ids[first].shape})"
    )


def tree_layout(samples: Sequence[TrainingSequence], share_across_groups: bool = True) -> TreeLayout:
    """The :class:`TreeLayout` of one row's samples (at least one, each non-empty; token ids >= 0): one trie per
    row (``share_across_groups``) or per group. A :class:`~asyncgrpo_cli.packing.trie.PlannedRow` (a row as the
    tree planner emitted it) brings its samples' placements under those rules; for any other sequence they are
    computed here, to the same values (one compiled insertion of the row, ``packing/trie.py``). A row's trie
    has one sub-trie per distinct first token (samples with different first tokens share nothing), so a row
    without cross-group sharing is laid out as with one trie per group."""
    if not samples:
        raise ValueError("cannot pack an empty row: the planner gives every rank at least one sample")
    lengths, cat = _check_ids(samples)
    n = lengths.shape[0]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    first: dict[Hashable, int] = {}
    group = np.array([first.setdefault(group_key(s), len(first)) for s in samples], dtype=np.int64)
    placed = samples.placements_for(lengths, share_across_groups) if isinstance(samples, PlannedRow) else None
    if placed is not None:
        parent, own_from = placed
    else:
        parent, own_from = placements(cat, offsets, np.zeros(n, np.int64) if share_across_groups else group)
    ids, depth, leave, seg_offsets, seg_parents, multiplicity, chunk_start = tree_arrays.layout(
        cat, offsets, parent, own_from, group
    )
    return TreeLayout(
        input_ids=ids,
        position_ids=depth,
        segment_offsets=seg_offsets,
        segment_parents=seg_parents,
        leave=leave,
        multiplicity=multiplicity,
        sample_offsets=offsets,
        flat_ids=cat,
        parent=parent,
        own_from=own_from,
        chunk_start=chunk_start,
    )


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
        masks, logprobs = row_arrays(samples, np.diff(layout.sample_offsets))
        mask = np.concatenate(masks).astype(np.bool_, copy=False).view(np.uint8)
        flat, pred, owner, trained, bad = tree_arrays.trained_terms(
            layout.sample_offsets, layout.parent, layout.own_from, layout.chunk_start, mask
        )
        if bad >= 0:
            raise untrainable_first_token(bad)
        terms = loss_terms(samples, flat, pred, owner, trained, layout.flat_ids, logprobs)
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
