"""A packed row's recurrence plan: what gated-DeltaNet layers need to treat every sample (and every branch) apart.

A packed row (``packing/row.py``) describes its structure only through DFS intervals: key ``k`` is an ancestor of
query ``q`` iff ``k <= q < leave[k]``. Attention needs nothing else; a recurrent layer does, and this module
derives it once per row (all layers and the backward share it):

- **segments**: maximal unary chains. Token ``q`` starts a segment iff ``q == 0`` or ``leave[q - 1] != leave[q]``
  (either ``q - 1`` is not an ancestor of ``q``, or it has other children after ``q``). All tokens of a segment
  share one ``leave``; a segment's parent is the deepest segment whose interval contains its start. Under
  sequence packing every sample is one root segment; under tree packing a branch point is always a segment end,
  so a child segment starts from the state its parent segment *ends* in.
- **path ancestors** ``ancestors[j, t]`` (``j = 1 .. K - 1``): the token ``j`` steps up ``t``'s root-to-token path
  (``T``, one past the last token, where the path is shorter): the short convolution's taps.
- **chunk grid** (``chunk`` tokens, 64 as transformers' and fla's kernels): every segment padded to whole chunks,
  ``grid_index`` [C * chunk] the packed token at each grid slot (``T`` = padding), ``token_slot`` [T] the inverse,
  and the chunk-level scan schedule: ``levels[d]`` the chunks whose state input is ``d`` chunk-steps from a root,
  ``level_inputs[d]`` where each gets it (its index in level ``d - 1``, or ``len(levels[d - 1])`` = zero state).
  Chunks of one level are independent, so the scan runs ``len(levels)`` batched steps (the longest path's
  chunks), not one step per chunk.
- **segment levels** (``segment_levels``): segments by depth in the segment tree, for kernels that run whole
  segments with ``cu_seqlens`` and an initial state per segment (``gdn/rule_fla.py``).

Index arithmetic runs in numpy on the host (one copy of ``leave``, O(T) work, a loop over segments only), the
resulting index tensors are placed on the row's device once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncgrpo_cli.device_copy import to_device

CHUNK = 64
"""Chunk length of the chunked delta rule (transformers' ``torch_chunk_gated_delta_rule`` and fla use 64)."""


@dataclass
class RecurrencePlan:
    """See the module docstring. Tensors live on the row's device; ``num_tokens`` = T."""

    num_tokens: int
    seg_start: np.ndarray
    seg_end: np.ndarray
    seg_parent: np.ndarray
    ancestors: torch.Tensor
    grid_index: torch.Tensor
    token_slot: torch.Tensor
    levels: list[torch.Tensor]
    level_inputs: list[torch.Tensor]
    segment_levels: list[np.ndarray]
    chunk: int = CHUNK

    @property
    def num_segments(self) -> int:
        return int(self.seg_start.shape[0])

    @property
    def num_chunks(self) -> int:
        return int(self.grid_index.shape[0]) // self.chunk


def segments(leave: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, parent) of the row's segments (end exclusive; parent -1 for a root), in pre-order."""
    n = int(leave.shape[0])
    starts_mask = np.ones(n, dtype=bool)
    starts_mask[1:] = leave[:-1] != leave[1:]
    start = np.flatnonzero(starts_mask)
    end = np.append(start[1:], n)
    sub_end = leave[start]
    parent = np.full(start.shape[0], -1, dtype=np.int64)
    stack: list[int] = []
    for s, q in enumerate(start.tolist()):
        while stack and sub_end[stack[-1]] <= q:
            stack.pop()
        if stack:
            parent[s] = stack[-1]
        stack.append(s)
    return start.astype(np.int64), end.astype(np.int64), parent


def build_plan(
    leave: torch.Tensor, conv_taps: int, chunk: int = CHUNK, device: torch.device | None = None
) -> RecurrencePlan:
    """The :class:`RecurrencePlan` of a row with DFS intervals ``leave`` (int64 [T]) for a conv of ``conv_taps``,
    its tensors on ``device`` (default: ``leave``'s; a CPU ``leave`` for a GPU row spares the read-back)."""
    device = leave.device if device is None else device
    lv = leave.detach().cpu().numpy().astype(np.int64)
    n = int(lv.shape[0])
    start, end, parent = segments(lv)
    seg_of = np.repeat(np.arange(start.shape[0]), end - start)

    # one step up each token's path: the previous token, or the parent segment's last token at a segment start
    up = np.arange(n, dtype=np.int64) - 1
    has_parent = parent >= 0
    up[start] = np.where(has_parent, end[np.maximum(parent, 0)] - 1, n)
    ancestors = np.empty((max(conv_taps - 1, 0), n), dtype=np.int64)
    cur = np.arange(n, dtype=np.int64)
    up_ext = np.append(up, n)
    for j in range(conv_taps - 1):
        cur = up_ext[cur]
        ancestors[j] = cur

    # chunk grid: each segment padded to whole chunks
    seg_chunks = (end - start + chunk - 1) // chunk
    chunk_base = np.cumsum(seg_chunks) - seg_chunks
    token_slot = chunk_base[seg_of] * chunk + (np.arange(n) - start[seg_of])
    total = int(seg_chunks.sum())
    grid_index = np.full(total * chunk, n, dtype=np.int64)
    grid_index[token_slot] = np.arange(n)

    # chunk scan schedule: a chunk's state input is its predecessor chunk's end state
    chunk_seg = np.repeat(np.arange(start.shape[0]), seg_chunks)
    first = chunk_base[chunk_seg] == np.arange(total)
    pred = np.arange(total, dtype=np.int64) - 1
    seg_last_chunk = chunk_base + seg_chunks - 1
    pred[first] = np.where(
        has_parent[chunk_seg[first]], seg_last_chunk[np.maximum(parent[chunk_seg[first]], 0)], -1
    )
    depth = np.zeros(total, dtype=np.int64)
    for c in range(total):  # pre-order: predecessors come first
        if pred[c] >= 0:
            depth[c] = depth[pred[c]] + 1
    levels, level_inputs = [], []
    pos_in_level = np.zeros(total, dtype=np.int64)
    prev_size = 0
    for d in range(int(depth.max(initial=-1)) + 1):
        members = np.flatnonzero(depth == d)
        pos_in_level[members] = np.arange(members.shape[0])
        inputs = np.where(pred[members] >= 0, pos_in_level[np.maximum(pred[members], 0)], prev_size)
        levels.append(to_device(torch.from_numpy(members), device))
        level_inputs.append(to_device(torch.from_numpy(inputs), device))
        prev_size = members.shape[0]

    seg_depth = np.zeros(start.shape[0], dtype=np.int64)
    for s in range(start.shape[0]):
        if parent[s] >= 0:
            seg_depth[s] = seg_depth[parent[s]] + 1
    segment_levels = [np.flatnonzero(seg_depth == d) for d in range(int(seg_depth.max(initial=-1)) + 1)]

    def on_device(a: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(a)), device)

    return RecurrencePlan(
        num_tokens=n,
        seg_start=start,
        seg_end=end,
        seg_parent=parent,
        ancestors=on_device(ancestors),
        grid_index=on_device(grid_index),
        token_slot=on_device(token_slot),
        levels=levels,
        level_inputs=level_inputs,
        segment_levels=segment_levels,
        chunk=chunk,
    )
