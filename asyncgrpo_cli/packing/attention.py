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
  - :func:`flex_block_mask`: a ``torch.nn.attention.flex_attention.BlockMask`` for compiled ``flex_attention``
    on CUDA (block-sparse, never materializes T²). CUDA only: flex attention on CPU has no backward (see
    docs/platform-notes.md), so this module imports flex lazily and refuses other devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

FLEX_BLOCK_SIZE = 128


def check_segments(offsets: np.ndarray, parents: np.ndarray) -> None:
    """Raise ValueError unless ``offsets`` / ``parents`` describe a pre-order segment forest."""
    if offsets.ndim != 1 or parents.ndim != 1 or offsets.shape[0] != parents.shape[0] + 1:
        raise ValueError(f"segment offsets {offsets.shape} / parents {parents.shape}: need [S + 1] / [S]")
    if offsets[0] != 0 or (np.diff(offsets) <= 0).any():
        raise ValueError("segment offsets must start at 0 and strictly increase (no empty segment)")
    if ((parents < -1) | (parents >= np.arange(parents.shape[0]))).any():
        raise ValueError("every segment's parent must be -1 or an earlier segment (pre-order)")


def segment_leave(offsets: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """int64 [S]: end (exclusive) of each segment's subtree. One pass over segments (children before parents).

    Raises ValueError when a subtree is not contiguous (the layout is not depth-first).
    """
    check_segments(offsets, parents)
    leave = offsets[1:].astype(np.int64, copy=True)
    size = np.diff(offsets).astype(np.int64)
    for s in range(parents.shape[0] - 1, 0, -1):  # per segment, not per token
        p = parents[s]
        if p >= 0:
            leave[p] = max(leave[p], leave[s])
            size[p] += size[s]
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


def tree_mask_mod(leave: torch.Tensor, block_size: int = FLEX_BLOCK_SIZE) -> Callable[..., torch.Tensor]:
    """The flex ``mask_mod`` of the intervals ``leave`` (int64 [T]): ``kv <= q < leave[kv]``.

    ``leave`` is padded by -1 to a multiple of ``block_size``, so keys past the row are never visible and
    ``leave[kv]`` stays in bounds for the padded indices flex evaluates.
    """
    n = int(leave.shape[0])
    bound = torch.full((-(-n // block_size) * block_size,), -1, dtype=torch.int64, device=leave.device)
    bound[:n] = leave

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_idx) & (q_idx < bound[kv_idx])

    return mask_mod


def flex_block_mask(leave: torch.Tensor, block_size: int = FLEX_BLOCK_SIZE) -> Any:
    """A flex-attention ``BlockMask`` of :func:`tree_mask_mod` for ``leave`` (int64 [T], on a CUDA device).

    Built with ``_compile=True``: build it once per row, outside the layers, and pass it to every attention
    call (transformers passes a ``BlockMask`` given as ``attention_mask`` through to ``flex_attention``).
    """
    if leave.device.type != "cuda":
        raise ValueError(
            f"flex_block_mask needs a CUDA tensor, got one on {leave.device}: flex attention has no CPU backward; "
            "on CPU use dense_mask with SDPA"
        )
    from torch.nn.attention.flex_attention import create_block_mask

    n = int(leave.shape[0])
    return create_block_mask(
        tree_mask_mod(leave, block_size),
        B=None,
        H=None,
        Q_LEN=n,
        KV_LEN=n,
        device=leave.device,
        BLOCK_SIZE=block_size,
        _compile=True,
    )
