"""The packed row: what one rank forwards in one micro-batch, plus the loss terms gathered from it.

A row is a single padding-free sequence of ``T`` forwarded tokens built from several samples. The loss is not
selected by a mask over the row but by an explicit gather: for every trained token ``t`` of every sample,
``pred_index`` is the packed position of its predecessor ``t - 1`` (the position whose output predicts ``t``).
Sequence packing gives each sample its own contiguous span; a tree packer that shares prefixes maps several
samples' tokens onto one packed position, so one position may appear several times in ``pred_index``, each time
with its own target, advantage and sampler log-prob. Both packers build the terms with :func:`gather_loss_terms`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from asyncgrpo_cli.packing.attention import dense_mask
from asyncgrpo_cli.rollout.candidates import CandidateSets
from asyncgrpo_cli.rollout.types import TrainingSequence


@dataclass
class PackedRow:
    """One rank's forward input and the per-trained-token loss terms (``N = num_trained`` rows each).

    Forward (batch dimension 1):
      - ``input_ids`` int64 [1, T], ``position_ids`` int64 [1, T] (each token's position in its own sample);
      - ``leave`` int64 [T]: the row's attention as DFS intervals (``packing/attention.py``): query ``q`` sees key
        ``k`` iff ``k <= q < leave[k]`` (exact per-sample isolation). The attention mask is rendered from it for
        the model's kernel (a dense mask for SDPA / eager, a BlockMask for flex), on the row's device.
    Loss terms, one entry per trained token:
      - ``pred_index`` int64 [N]: packed position whose output predicts the token;
      - ``target_ids`` int64 [N], ``sampler_logprobs`` float32 [N], ``advantages`` float32 [N];
      - ``sample_index`` int64 [N]: which sample of the row (0 .. num_samples - 1) the token belongs to;
      - ``topk_ids`` int64 [N, K] (pad -1) and ``topk_logprobs`` float32 [N, K] (pad -inf): the sampler's most
        likely tokens at that position; K = 0 when no sample carries them;
      - ``support_ids`` int64 [N, C] (pad -1) or None: each token's sampling candidate set (top-k / top-p / min-p
        mask, ``rollout/candidates.py``), C = the row's largest set; a row of -1 means the full vocabulary. None
        when no sample of the row carries a set. The trainer renormalizes its log-probs over it.
    Counts: ``num_forwarded`` = T, ``num_trained`` = N, ``num_samples``, and ``num_unpacked`` = Σ sample lengths
    (equal to T for sequence packing; larger under prefix sharing).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    leave: torch.Tensor
    pred_index: torch.Tensor
    target_ids: torch.Tensor
    sampler_logprobs: torch.Tensor
    advantages: torch.Tensor
    sample_index: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    num_forwarded: int
    num_trained: int
    num_samples: int
    num_unpacked: int
    support_ids: torch.Tensor | None = field(default=None, kw_only=True)

    @property
    def attention_mask(self) -> torch.Tensor:
        """bool [1, 1, T, T], True = query may attend to key: built from ``leave`` on each access (T² bytes)."""
        return dense_mask(self.leave)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedRow:
        """A copy with every tensor on ``device`` (counts unchanged)."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def _topk_width(samples: Sequence[TrainingSequence]) -> int:
    widths = [s.topk_ids.shape[1] for s in samples if s.topk_ids is not None and s.topk_ids.ndim == 2]
    return max(widths, default=0)


def _sample_topk(sample: TrainingSequence, n: int, k: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """The sample's top-k arrays, padded to width ``k`` (id -1, log-prob -inf); empty rows when absent."""
    ids = np.full((n, k), -1, dtype=np.int64)
    lps = np.full((n, k), -np.inf, dtype=np.float32)
    if sample.topk_ids is None or k == 0:
        return ids, lps
    if sample.topk_ids.shape[0] != n or sample.topk_logprobs is None or sample.topk_logprobs.shape[0] != n:
        raise ValueError(
            f"sample {index} ({sample.rollout_id or 'no rollout id'}) has {n} trained tokens but top-k arrays of "
            f"shapes {sample.topk_ids.shape} / {None if sample.topk_logprobs is None else sample.topk_logprobs.shape}"
        )
    width = sample.topk_ids.shape[1]
    ids[:, :width] = sample.topk_ids
    lps[:, :width] = np.where(sample.topk_ids >= 0, sample.topk_logprobs, -np.inf)
    return ids, lps


def _support_ids(samples: Sequence[TrainingSequence], trained: Sequence[int]) -> torch.Tensor | None:
    """The samples' candidate sets, one row per trained token in order ([N, C], -1 padding); None if none has any.

    A tree row maps several samples onto one packed position, but the sets stay per sample (per branch), aligned
    with ``target_ids`` like every other loss term.
    """
    if all(s.sampling_mask is None for s in samples):
        return None
    parts = []
    for i, (sample, n) in enumerate(zip(samples, trained, strict=True)):
        sets = sample.sampling_mask
        if sets is None:
            parts.append(CandidateSets.empty(n))
        elif len(sets) != n:
            raise ValueError(
                f"sample {i} ({sample.rollout_id or 'no rollout id'}) has {n} trained tokens but {len(sets)} "
                "candidate sets (sampling_mask)"
            )
        else:
            parts.append(sets)
    return torch.from_numpy(CandidateSets.concat(parts).padded())


def gather_loss_terms(
    samples: Sequence[TrainingSequence], packed_positions: Sequence[np.ndarray]
) -> dict[str, torch.Tensor | None]:
    """Per-trained-token loss terms of ``samples``.

    ``packed_positions[s][i]`` is the packed row position of token ``i`` of sample ``s``. For each trained token
    ``t`` (``train_mask[t]``, t >= 1): ``pred_index = packed_positions[s][t - 1]``, ``target_ids = input_ids[t]``,
    plus the sample's sampler log-prob, advantage, index, top-k rows and candidate set (``support_ids``). Returns
    the ``PackedRow`` loss fields.
    """
    k = _topk_width(samples)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in _TERM_DTYPES}
    for s, (sample, pos) in enumerate(zip(samples, packed_positions, strict=True)):
        trained = np.flatnonzero(sample.train_mask)
        if trained.size and trained[0] == 0:
            raise ValueError(f"sample {s}: token 0 is marked trained but has no predecessor to predict it")
        ids, lps = _sample_topk(sample, trained.size, k, s)
        parts["pred_index"].append(np.asarray(pos)[trained - 1])
        parts["target_ids"].append(sample.input_ids[trained])
        parts["sampler_logprobs"].append(sample.sampler_logprobs[trained])
        parts["advantages"].append(np.full(trained.size, sample.advantage))
        parts["sample_index"].append(np.full(trained.size, s))
        parts["topk_ids"].append(ids)
        parts["topk_logprobs"].append(lps)
    out = {}
    for name, dtype in _TERM_DTYPES.items():
        empty = np.zeros((0, k) if name.startswith("topk") else 0, dtype=dtype)
        arr = np.concatenate(parts[name]).astype(dtype, copy=False) if parts[name] else empty
        out[name] = torch.from_numpy(np.ascontiguousarray(arr))
    out["support_ids"] = _support_ids(samples, [int(s.train_mask.sum()) for s in samples])
    return out


_TERM_DTYPES = {
    "pred_index": np.int64,
    "target_ids": np.int64,
    "sampler_logprobs": np.float32,
    "advantages": np.float32,
    "sample_index": np.int64,
    "topk_ids": np.int64,
    "topk_logprobs": np.float32,
}
