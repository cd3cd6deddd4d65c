"""Sequence packing: a row's samples concatenated padding-free, each attending only to itself.

Layout for samples of lengths L_0, L_1, ... at offsets o_s = Σ_{j<s} L_j::

    input_ids    = concat(sample_0, sample_1, ...)            [1, T],  T = Σ L_s
    position_ids = concat(arange(L_0), arange(L_1), ...)      [1, T]   (restart at 0 per sample: RoPE unchanged)
    mask[q, k]   = seg[q] == seg[k] and k <= q                [1, 1, T, T], True = attend

The mask is block-diagonal causal, so each token's output equals that of a forward of its sample alone. It is
built by the tree machinery of ``packing/attention.py``: sequence packing is a forest of parentless segments.

Why an explicit 4D mask (verified on transformers 5.24, see tests/test_packing.py): a 4D tensor passed as
``attention_mask`` reaches the attention function unchanged. SDPA reads a bool mask as True = attend; eager
attention adds the mask to the scores, so the log-prob head hands eager models the additive form (a bool mask
there is silently wrong). Position-id resets alone also yield block-diagonal attention, but only when no cache
exists: the decoder's ``use_cache`` defaults to the model config's (True), a DynamicCache is then created and
transformers silently falls back to plain causal attention over the whole row, so samples see each other. The
explicit mask does not depend on that (the head also passes ``use_cache=False``). The row carries only the
intervals (``leave``); the log-prob head renders them as a dense mask for SDPA / eager (T² bytes, 64 MiB at 8k
tokens: fine on CPU) or as a block-sparse flex ``BlockMask`` on CUDA (``model/flex.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.packing.row import PackedRow, gather_loss_terms, sequence_fields
from asyncgrpo_cli.samples import TrainingSequence


def _same(flat: np.ndarray) -> np.ndarray:
    return flat


class SequencePacker:
    """Packs one row's samples by concatenation (no prefix sharing); see the module docstring for the layout."""

    planner = "asyncgrpo_cli.packing.planner:TokenBudgetPlanner"

    def __init__(self, cfg: PackingConfig) -> None:
        self.cfg = cfg

    def pack(self, samples: Sequence[TrainingSequence]) -> PackedRow:
        """The packed row of ``samples`` (at least one, each non-empty)."""
        if not samples:
            raise ValueError("cannot pack an empty row: the planner gives every rank at least one sample")
        lengths = np.fromiter((s.input_ids.shape[0] for s in samples), dtype=np.int64, count=len(samples))
        if (lengths == 0).any():
            raise ValueError(f"cannot pack an empty sample (lengths {lengths.tolist()})")
        total = int(lengths.sum())
        input_ids = np.concatenate([s.input_ids for s in samples]).astype(np.int64, copy=False)
        # a flat token index is its packed position
        terms = gather_loss_terms(samples, _same, input_ids, lengths)
        row = PackedRow(
            input_ids=torch.from_numpy(input_ids)[None],
            **sequence_fields(lengths),
            **terms,
            num_forwarded=total,
            num_trained=int(terms["target_ids"].shape[0]),
            num_samples=len(samples),
            num_unpacked=total,
        )
        row.segment_lengths = lengths
        return row
