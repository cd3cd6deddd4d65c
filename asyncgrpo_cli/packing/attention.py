"""Attention of a packed row from its segment tree: DFS intervals, a dense mask (CPU), a flex BlockMask (CUDA).

A packed row is a forest of *segments* laid out depth-first (pre-order): segment ``s`` covers packed positions
``[offsets[s], offsets[s + 1])`` and hangs below segment ``parents[s]`` (-1: a root; parents precede children).
Every token sees exactly its root-to-token path: its own segment up to itself, and all of its ancestor segments.

DFS intervals make that an O(1) test per (query, key) pair. With ``enter[t] = t`` (pre-order position) and
``leave[t]`` = the end of the subtree of ``t``'s segment (exclusive), key ``k`` is on the path of query ``q`` iff

    enter[k] <= enter[q] < leave[k]

(ancestor segments lie before ``q`` and their subtree covers it; earlier siblings' subtrees end before ``q``;
inside one segment it is plain causality). Sequence packing is the special case of parentless segments, where
``leave[k]`` is the end of ``k``'s own sample: the mask is block-diagonal causal.

Two renderings of the same intervals:
  - :func:`dense_mask`: bool [1, 1, T, T] (True = attend) for SDPA / eager attention. T² bytes, fine on CPU and
    for the budgets the CPU path uses.
  - :func:`flex_block_mask`: a ``torch.nn.attention.flex_attention.BlockMask`` for ``flex_attention`` (CUDA for
    training: flex has no CPU backward, see docs/platform-notes.md). It is built from the intervals at block
    granularity, never from a T² evaluation: for query block i and key block j < i (B = block size), every key of
    j precedes every query of i, so the block is

        full     iff  min(leave[j-block]) > last query of i     (every pair visible: mask_mod skipped)
        non-empty iff max(leave[j-block]) > first query of i    (some pair visible: mask_mod applied)

    and a diagonal block is partial (empty above the diagonal). That is a few [T/B, T/B] tensor operations on
    the row's device per row, and equals ``create_block_mask`` of :func:`tree_mask_mod` exactly.

Compiled flex attention is kept to static shapes (``model/flex.py`` says why), so :func:`flex_length` pads a row
to a power-of-two bucket (a handful of compiled shapes per run). Padding is nearly free: padded keys are in no block list and
padded queries have none, so the kernel skips them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numba import njit

FLEX_BLOCK_SIZE = 128
"""Sparse block size of the flex BlockMask (flex's default)."""
FLEX_MIN_LENGTH = 1024
"""Smallest padded length of a compiled flex row (see :func:`flex_length`)."""


def check_segments(offsets: np.ndarray, parents: np.ndarray) -> None:
    """Raise ValueError unless ``offsets`` / ``parents`` describe a pre-order segment forest."""
    if offsets.ndim != 1 or parents.ndim != 1 or offsets.shape[0] != parents.shape[0] + 1:
        raise ValueError(f"segment offsets {offsets.shape} / parents {parents.shape}: need [S + 1] / [S]")
    if offsets[0] != 0 or (np.diff(offsets) <= 0).any():
        raise ValueError("segment offsets must start at 0 and strictly increase (no empty segment)")
    if ((parents < -1) | (parents >= np.arange(parents.shape[0]))).any():
        raise ValueError("every segment's parent must be -1 or an earlier segment (pre-order)")


@njit(cache=True, nogil=True)
def subtree_spans(offsets: np.ndarray, parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(end, size) int64 [S] of each segment's subtree: the largest end and the total length of the segments below
    it, itself included. Parents precede their children, so one backward pass hands every segment's to its parent
    after all of its own descendants have (compiled: the tree packer's layout calls it per row)."""
    end = offsets[1:].copy()
    size = offsets[1:] - offsets[:-1]
    for g in range(parents.shape[0] - 1, -1, -1):
        up = parents[g]
        if up >= 0:
            end[up] = max(end[up], end[g])
            size[up] += size[g]
    return end, size


def segment_leave(offsets: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """int64 [S]: end (exclusive) of each segment's subtree: the largest end of a segment below it (itself
    included; :func:`subtree_spans`).

    Raises ValueError when a subtree is not contiguous (the layout is not depth-first).
    """
    check_segments(offsets, parents)
    offsets = offsets.astype(np.int64, copy=False)
    leave, size = subtree_spans(offsets, parents.astype(np.int64, copy=False))
    if (leave - offsets[:-1] != size).any():
        raise ValueError("segment subtrees are not contiguous: the row is not laid out depth-first")
    return leave


def token_leave(offsets: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """int64 [T]: ``leave`` of each token (its segment's subtree end). ``enter`` is ``arange(T)``."""
    return np.repeat(segment_leave(offsets, parents), np.diff(offsets))


def sequence_leave(lengths: np.ndarray) -> np.ndarray:
    """int64 [T] ``leave`` of a sequence-packed row: parentless segments of the given lengths."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.repeat(np.cumsum(lengths), lengths)


def dense_mask(leave: torch.Tensor | np.ndarray) -> torch.Tensor:
    """bool [1, 1, T, T]: ``mask[q, k] = k <= q < leave[k]`` (True = attend), on ``leave``'s device."""
    leave = torch.as_tensor(leave, dtype=torch.int64)
    idx = torch.arange(leave.shape[0], device=leave.device)
    return ((idx[None, :] <= idx[:, None]) & (idx[:, None] < leave[None, :]))[None, None]


def flex_length(n: int) -> int:
    """The length a row of ``n`` tokens runs compiled flex attention at: the next power of two >= max(n, 1024).

    Up to a 64k-token row that is at most 7 shapes, each compiled once (under dynamo's default recompile limit).
    """
    return max(FLEX_MIN_LENGTH, 1 << (max(n, 1) - 1).bit_length())


def _padded_leave(leave: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """``leave`` padded with -1 to ``length`` rounded up to whole blocks (padded keys are never visible)."""
    n = int(leave.shape[0])
    if length < n:
        raise ValueError(f"flex length {length} is shorter than the row ({n} tokens)")
    bound = torch.full((-(-length // block_size) * block_size,), -1, dtype=torch.int64, device=leave.device)
    bound[:n] = leave
    return bound


def tree_mask_mod(
    leave: torch.Tensor, length: int | None = None, block_size: int = FLEX_BLOCK_SIZE
) -> Callable[..., torch.Tensor]:
    """The flex ``mask_mod`` of the intervals ``leave`` (int64 [T]): ``kv <= q < leave[kv]``.

    ``leave`` is padded by -1 to ``length`` (default T) rounded up to whole blocks, so keys past the row are never
    visible and ``leave[kv]`` stays in bounds for the padded indices flex evaluates. Queries past the row see
    nothing (every ``leave`` is <= T).
    """
    return _mask_mod(_padded_leave(leave, int(leave.shape[0]) if length is None else length, block_size))


def _mask_mod(bound: torch.Tensor) -> Callable[..., torch.Tensor]:
    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_idx) & (q_idx < bound[kv_idx])

    return mask_mod


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [Q, K] block matrix -> (count int32 [1, 1, Q], indices int32 [1, 1, Q, K], set blocks first, ascending)."""
    count = blocks.sum(-1, dtype=torch.int32)
    indices = torch.sort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
    return count[None, None], indices[None, None]


def flex_block_mask(leave: torch.Tensor, length: int | None = None, block_size: int = FLEX_BLOCK_SIZE) -> Any:
    """The flex-attention ``BlockMask`` of the intervals ``leave`` (int64 [T]) at ``length`` (default T) tokens.

    Built from per-block minima and maxima of ``leave`` (see the module docstring), on ``leave``'s device. Build
    it once per row and pass it as ``attention_mask``: it reaches every layer's attention unchanged. With
    ``length > T`` the q/k/v of the row must be padded to ``length`` (``model/flex.py`` does that).
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = int(leave.shape[0])
    length = n if length is None else int(length)
    bound = _padded_leave(leave.to(torch.int64), length, block_size)
    num_blocks = bound.shape[0] // block_size
    per_block = bound.view(num_blocks, block_size)
    lo, hi = per_block.amin(1), per_block.amax(1)  # a block holding padding (-1) is never full
    idx = torch.arange(num_blocks, device=leave.device)
    first_q, last_q = idx * block_size, idx * block_size + block_size - 1
    below = idx[None, :] < idx[:, None]  # [query block, key block]: key block strictly before query block
    full = below & (lo[None, :] > last_q[:, None])
    some = below & (hi[None, :] > first_q[:, None])
    diagonal = (idx[None, :] == idx[:, None]) & (first_q < n)[:, None]  # holds a real token: partial (causal)
    kv_num, kv_idx = _ordered((some & ~full) | diagonal)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=_mask_mod(bound),
        seq_lengths=(length, length),
    )
