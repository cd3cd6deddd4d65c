"""The packed row: what one rank forwards in one micro-batch, plus the loss terms gathered from it.

A row is a single padding-free sequence of ``T`` forwarded tokens built from several samples. The loss is not
selected by a mask over the row but by an explicit gather: for every trained token ``t`` of every sample,
``pred_index`` is the packed position of its predecessor ``t - 1`` (the position whose output predicts ``t``).
Sequence packing gives each sample its own contiguous span; a tree packer that shares prefixes maps several
samples' tokens onto one packed position, so one position may appear several times in ``pred_index``, each time
with its own target, advantage and sampler log-prob. Both packers build the terms with :func:`gather_loss_terms`,
including the samples' named per-token extras (``TrainingSequence.token_extras`` -> ``PackedRow.extras``), so a
tree packer maps extras through its layout exactly as it maps sampler log-probs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any

import numpy as np
import torch

from asyncgrpo_cli.samples import CandidateSets, TopK, TrainingSequence
from tests.helpers.packing_reference.attention import dense_mask


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
      - ``support_ids`` int64 [N, C] (pad -1) or None: each token's sampling candidate set (top-k / top-p / min-p
        mask, ``samples.CandidateSets``), C = the row's largest set; a row of -1 means the full vocabulary. None
        when no sample of the row carries a set. The trainer renormalizes its log-probs over it.
      - ``extras``: name -> the samples' token extra of that name (``TrainingSequence.token_extras``), N rows as
        torch tensors, e.g. ``extras["sampler_topk"]``, a ``TopK`` of ids int64 [N, K] (pad -1) and log-probs
        float32 [N, K] (pad -inf). A name appears when any sample of the row carries it; samples without it
        contribute ``empty`` rows.
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
    num_forwarded: int
    num_trained: int
    num_samples: int
    num_unpacked: int
    support_ids: torch.Tensor | None = field(default=None, kw_only=True)
    multiplicity: torch.Tensor | None = field(default=None, kw_only=True)
    extras: dict[str, Any] = field(default_factory=dict, kw_only=True)

    @property
    def attention_mask(self) -> torch.Tensor:
        """bool [1, 1, T, T], True = query may attend to key: built from ``leave`` on each access (T² bytes)."""
        return dense_mask(self.leave)

    @property
    def candidate_ids(self) -> torch.Tensor | None:
        """int64 [N, ΣK]: the ids of the row's ``TopK`` extras side by side (in ``extras`` order), which the head
        scores for a loss that needs extras (``TokenStats.topk_logprobs``); None when the row has none."""
        ids = [extra.ids for extra in self.extras.values() if isinstance(extra, TopK)]
        if not ids:
            return None
        return ids[0] if len(ids) == 1 else torch.cat(ids, dim=1)

    def candidate_columns(self, name: str) -> slice:
        """The columns of ``candidate_ids`` (and of ``TokenStats.topk_logprobs``) that belong to the ``TopK`` extra
        ``name``: extras sit side by side in ``extras`` order. KeyError when the row has no such extra."""
        start = 0
        for key, extra in self.extras.items():
            if not isinstance(extra, TopK):
                continue
            width = int(extra.ids.shape[1])
            if key == name:
                return slice(start, start + width)
            start += width
        raise KeyError(
            f"the packed row has no top-k extra {name!r} (extras: {', '.join(self.extras) or 'none'})"
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedRow:
        """A copy with every tensor (extras included) on ``device`` (counts unchanged)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        moved: dict[str, Any] = {
            f.name: move(getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        moved["extras"] = {
            name: _map_arrays(extra, torch.Tensor, move) for name, extra in self.extras.items()
        }
        return replace(self, **moved)


def _map_arrays(extra: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """A copy of the token extra ``extra`` (a dataclass) with ``fn`` applied to every field of type ``kind``."""
    if not is_dataclass(extra):
        raise TypeError(f"a token extra must be a dataclass of arrays, got {type(extra).__name__}")
    return replace(
        extra, **{f.name: fn(v) for f in fields(extra) if isinstance(v := getattr(extra, f.name), kind)}
    )


def _as_tensors(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


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


def _gather_extras(samples: Sequence[TrainingSequence], trained: Sequence[int]) -> dict[str, Any]:
    """Every token extra any sample of the row carries, by name: the samples' rows one after another (aligned
    with ``target_ids``), ``empty`` rows for a sample without it, numpy fields turned into tensors."""
    names = dict.fromkeys(name for sample in samples for name in sample.token_extras)
    out = {}
    for name in names:
        kind = type(next(s.token_extras[name] for s in samples if name in s.token_extras))
        parts = []
        for i, (sample, n) in enumerate(zip(samples, trained, strict=True)):
            extra = sample.token_extras.get(name)
            if extra is None:
                parts.append(kind.empty(n))
            elif len(extra) != n:
                raise ValueError(
                    f"sample {i} ({sample.rollout_id or 'no rollout id'}) has {n} trained tokens but "
                    f"{len(extra)} rows in token_extras[{name!r}] (one per trained token)"
                )
            else:
                parts.append(extra)
        out[name] = _map_arrays(kind.concat(parts), np.ndarray, _as_tensors)
    return out


def gather_loss_terms(
    samples: Sequence[TrainingSequence], packed_positions: Sequence[np.ndarray]
) -> dict[str, Any]:
    """Per-trained-token loss terms of ``samples``.

    ``packed_positions[s][i]`` is the packed row position of token ``i`` of sample ``s``. For each trained token
    ``t`` (``train_mask[t]``, t >= 1): ``pred_index = packed_positions[s][t - 1]``, ``target_ids = input_ids[t]``,
    plus the sample's sampler log-prob, advantage, index, candidate set (``support_ids``) and token extras
    (``extras``, by name). Returns the ``PackedRow`` loss fields.
    """
    parts: dict[str, list[np.ndarray]] = {name: [] for name in _TERM_DTYPES}
    for s, (sample, pos) in enumerate(zip(samples, packed_positions, strict=True)):
        trained = np.flatnonzero(sample.train_mask)
        if trained.size and trained[0] == 0:
            raise ValueError(f"sample {s}: token 0 is marked trained but has no predecessor to predict it")
        parts["pred_index"].append(np.asarray(pos)[trained - 1])
        parts["target_ids"].append(sample.input_ids[trained])
        parts["sampler_logprobs"].append(sample.sampler_logprobs[trained])
        parts["advantages"].append(np.full(trained.size, sample.advantage))
        parts["sample_index"].append(np.full(trained.size, s))
    out: dict[str, Any] = {}
    for name, dtype in _TERM_DTYPES.items():
        empty = np.zeros(0, dtype=dtype)
        arr = np.concatenate(parts[name]).astype(dtype, copy=False) if parts[name] else empty
        out[name] = _as_tensors(arr)
    trained_counts = [int(s.train_mask.sum()) for s in samples]
    out["support_ids"] = _support_ids(samples, trained_counts)
    out["extras"] = _gather_extras(samples, trained_counts)
    return out


_TERM_DTYPES = {
    "pred_index": np.int64,
    "target_ids": np.int64,
    "sampler_logprobs": np.float32,
    "advantages": np.float32,
    "sample_index": np.int64,
}
