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
from itertools import chain
from typing import Any

import numpy as np
import torch

from asyncgrpo_cli.device_copy import to_device
from asyncgrpo_cli.packing.attention import dense_mask, sequence_leave
from asyncgrpo_cli.samples import TeacherTopK, TopK, TrainingSequence


@dataclass
class PackedRow:
    """One rank's forward input and the per-trained-token loss terms (``N = num_trained`` rows each).

    Forward (batch dimension 1):
      - ``input_ids`` int64 [1, T], ``position_ids`` int64 [1, T] (each token's position in its own sample);
      - ``leave`` int64 [T]: the row's attention as DFS intervals (``packing/attention.py``): query ``q`` sees key
        ``k`` iff ``k <= q < leave[k]`` (exact per-sample isolation). The attention mask is rendered from it for
        the model's kernel (a dense mask for SDPA / eager, a BlockMask for flex), on the row's device.
      - ``multiplicity`` int64 [T] or None: how many of the row's samples have each forwarded token on their path
        (Σ = ``num_unpacked``): 1 everywhere under sequence packing, k on a prefix that k samples share under tree
        packing. It weights per-token statistics that must equal those of the samples forwarded unpacked (the MoE
        router aux loss, ``model/router.py``). None (a packer that does not set it): one sample per token.
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

    host_leave = None
    """Not a field (rows compare and copy without it): on a row that :meth:`to` moved off the CPU, the CPU tensor
    ``leave`` came from, so the hybrid's recurrence plan (``model/gdn/plan.py``) is built without reading
    ``leave`` back from the device. None elsewhere."""

    segment_lengths = None
    """Not a field: on a host row the sequence packer made, its samples' lengths (int64 numpy [n]), from which
    ``position_ids``, ``leave`` and ``multiplicity`` follow (:func:`sequence_fields`): the row pickles them
    instead of those three. A copy (``replace``, :meth:`to`) does not carry it. None elsewhere."""

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
        """A copy with every tensor (extras included) on ``device`` (counts unchanged); ``non_blocking``: to a GPU
        through pinned memory, so the host does not wait for the GPU's queued work (``device_copy.py``)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return to_device(t, device) if non_blocking else t.to(device)

        moved: dict[str, Any] = {
            f.name: move(getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        moved["extras"] = {
            name: _map_arrays(extra, torch.Tensor, move) for name, extra in self.extras.items()
        }
        out = replace(self, **moved)
        if torch.device(device).type != "cpu":
            out.host_leave = self.leave if self.leave.device.type == "cpu" else self.host_leave
        return out

    def __reduce__(self) -> tuple:
        """Pickled with its host tensors as numpy arrays, rebuilt with ``torch.from_numpy``. torch pickles each
        tensor's storage through ``torch.save`` (~80 us a tensor, ~1.2 ms a row); rank 0 scatters packed rows to
        the other ranks every step (``train/distributed.py``), ~5x cheaper this way (``asyncgrpo bench
        scatter``). Tensors numpy cannot hold (a device's, bfloat16) pickle as torch pickles them."""
        lengths = self.segment_lengths
        derived = () if lengths is None else ("position_ids", "leave", "multiplicity")  # sequence_fields
        state = {f.name: _to_numpy(getattr(self, f.name)) for f in fields(self) if f.name not in derived}
        state["extras"] = {name: _map_arrays(e, torch.Tensor, _to_numpy) for name, e in self.extras.items()}
        return (_rebuild_row, (type(self), state, _to_numpy(self.host_leave), lengths))


def sequence_fields(lengths: np.ndarray) -> dict[str, torch.Tensor]:
    """``position_ids`` [1, T], ``leave`` [T] and ``multiplicity`` [T] (all ones) of a sequence-packed row of
    samples of ``lengths`` (parentless segments; each token's position counts from its own sample's start)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    leave = sequence_leave(lengths)
    positions = np.arange(leave.shape[0]) - (leave - np.repeat(lengths, lengths))  # minus its sample's start
    return {
        "position_ids": torch.from_numpy(positions)[None],
        "leave": torch.from_numpy(leave),
        "multiplicity": torch.ones(leave.shape[0], dtype=torch.int64),
    }


def _to_numpy(value: Any) -> Any:
    """A host tensor as the numpy array sharing its memory; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.requires_grad:
        try:
            return value.numpy()
        except TypeError:  # a dtype numpy has not (bfloat16)
            return value
    return value


def _rebuild_row(
    kind: type, state: dict[str, Any], host_leave: Any, lengths: np.ndarray | None = None
) -> PackedRow:
    """The row :meth:`PackedRow.__reduce__` pickled: its numpy arrays back as tensors (a row holds no arrays), a
    sequence-packed row's layout rebuilt from its samples' ``lengths``."""

    def tensor(value: Any) -> Any:
        return torch.from_numpy(value) if isinstance(value, np.ndarray) else value

    state = {name: tensor(value) for name, value in state.items()}
    state["extras"] = {name: _map_arrays(e, np.ndarray, tensor) for name, e in state["extras"].items()}
    if lengths is not None:
        state.update(sequence_fields(lengths))
    row = kind(**state)
    if host_leave is not None:
        row.host_leave = tensor(host_leave)
    row.segment_lengths = lengths
    return row


def _map_arrays(extra: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """A copy of the token extra ``extra`` (a dataclass) with ``fn`` applied to every field of type ``kind``."""
    if not is_dataclass(extra):
        raise TypeError(f"a token extra must be a dataclass of arrays, got {type(extra).__name__}")
    return replace(
        extra, **{f.name: fn(v) for f in fields(extra) if isinstance(v := getattr(extra, f.name), kind)}
    )


def _as_tensors(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _support_ids(samples: Sequence[TrainingSequence], trained: np.ndarray) -> torch.Tensor | None:
    """The samples' candidate sets, one row per trained token in order ([N, C], -1 padding); None if none has any.

    A tree row maps several samples onto one packed position, but the sets stay per sample (per branch), aligned
    with ``target_ids`` like every other loss term. Equal to ``CandidateSets.concat(...).padded()`` with
    ``CandidateSets.empty`` for a sample without sets, built from the sets' sizes in one pass.
    """
    if all(s.sampling_mask is None for s in samples):
        return None
    sizes, ids = [], []
    for i, (sample, n) in enumerate(zip(samples, trained.tolist(), strict=True)):
        sets = sample.sampling_mask
        if sets is None:
            sizes.append(np.zeros(n, np.int64))
        elif len(sets) != n:
            raise ValueError(
                f"sample {i} ({sample.rollout_id or 'no rollout id'}) has {n} trained tokens but {len(sets)} "
                "candidate sets (sampling_mask)"
            )
        else:
            sizes.append(np.diff(sets.offsets))
            ids.append(sets.ids)
    size = np.concatenate(sizes)
    out = np.full((size.shape[0], int(size.max(initial=0))), -1, dtype=np.int64)
    rows = np.repeat(np.arange(size.shape[0]), size)
    cols = np.arange(rows.shape[0]) - np.repeat(np.cumsum(size) - size, size)
    out[rows, cols] = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    return torch.from_numpy(out)


def _topk_fast(kind: type, extras: list[Any], trained: np.ndarray) -> Any | None:
    """The usual row's ``kind`` (``TopK`` or ``TeacherTopK``) extra: every sample carries a part of one width K
    with one row per trained token, checked by array operations over the parts' row counts and one
    concatenation per field into a preallocated [N, K] array (no sample lacks it: the caller checked). None for
    any other row (:func:`_concat_topk`)."""
    id_parts = [p.ids for p in extras]
    lp_parts = [p.logprobs for p in extras]
    first = id_parts[0]
    k = first.shape[1] if first.ndim == 2 else 0
    count = len(extras)
    if not (
        k
        and np.array_equal(np.fromiter(map(len, id_parts), np.int64, count=count), trained)
        and np.array_equal(np.fromiter(map(len, lp_parts), np.int64, count=count), trained)
    ):
        return None
    n_rows = int(trained.sum())
    ids = np.empty((n_rows, k), dtype=np.int64)
    lps = np.empty((n_rows, k), dtype=np.float32)
    try:  # every part [n_i, k]: else numpy refuses the shapes and the per-part path explains
        np.concatenate(id_parts, out=ids, casting="unsafe")
        np.concatenate(lp_parts, out=lps, casting="unsafe")
    except ValueError:
        return None
    np.copyto(lps, -np.inf, where=ids < 0)
    return _topk_of(kind, extras, trained, ids, lps)


def _concat_topk(kind: type, extras: list[Any], trained: np.ndarray) -> Any:
    """``kind.concat`` (``TopK`` or ``TeacherTopK``) of the row's parts, ``kind.empty(n)`` where ``extras[i]`` is
    None (rows of every sample checked already), written into one preallocated [N, K] pair of arrays per width
    instead of one pair per sample."""
    n_rows = int(trained.sum())
    starts = np.cumsum(trained) - trained
    by_width: dict[int, list[int]] = {}
    for i, p in enumerate(extras):
        if p is None:
            continue
        shape = p.ids.shape
        if len(shape) != 2 or shape != p.logprobs.shape:
            raise ValueError(
                f"top-k ids {shape} and log-probs {p.logprobs.shape} must be [n, K] arrays of one shape"
            )
        if shape[1]:
            by_width.setdefault(shape[1], []).append(i)
    k = max(by_width, default=0)
    ids = np.full((n_rows, k), -1, dtype=np.int64)
    lps = np.full((n_rows, k), -np.inf, dtype=np.float32)
    for w, members in by_width.items():
        part_ids = np.concatenate([extras[i].ids for i in members])
        part_lps = np.where(part_ids >= 0, np.concatenate([extras[i].logprobs for i in members]), -np.inf)
        if len(members) == len(extras):
            ids[:, :w], lps[:, :w] = part_ids, part_lps
        else:
            m = np.asarray(members)
            rows = np.repeat(starts[m] - (np.cumsum(trained[m]) - trained[m]), trained[m])
            rows += np.arange(rows.shape[0])
            ids[rows, :w], lps[rows, :w] = part_ids, part_lps
    return _topk_of(kind, extras, trained, ids, lps)


def _topk_of(kind: type, extras: list[Any], trained: np.ndarray, ids: np.ndarray, lps: np.ndarray) -> Any:
    """The row's ``kind`` (``TopK`` or ``TeacherTopK``) of the concatenated ``ids`` / ``lps``."""
    if kind is TopK:
        return TopK(ids, lps)
    names = {p.teacher_names for p in extras if p is not None and p.teacher_names}
    if len(names) > 1:
        raise ValueError(f"teacher scores of one row name different teacher sets: {sorted(names)}")
    teacher = [
        np.full(int(n), -1, dtype=np.int64) if p is None else np.asarray(p.teacher, dtype=np.int64)
        for p, n in zip(extras, trained, strict=True)
    ]
    return TeacherTopK(ids, lps, teacher=np.concatenate(teacher), teacher_names=next(iter(names), ()))


def _gather_extras(samples: Sequence[TrainingSequence], trained: np.ndarray) -> dict[str, Any]:
    """Every token extra any sample of the row carries, by name: the samples' rows one after another (aligned
    with ``target_ids``), ``empty`` rows for a sample without it, numpy fields turned into tensors. ``TopK`` and
    ``TeacherTopK`` extras are concatenated by :func:`_concat_topk` (the same arrays as their ``concat``)."""
    by_sample = [sample.token_extras for sample in samples]
    names = dict.fromkeys(chain.from_iterable(by_sample))
    out = {}
    for name in names:
        extras = [d.get(name) for d in by_sample]
        kinds = set(map(type, extras))  # ``None in extras`` would call each extra's __eq__
        missing = type(None) in kinds
        kinds.discard(type(None))
        kind = type(next(e for e in extras if e is not None))
        fast = len(kinds) == 1 and kind in (TopK, TeacherTopK)
        merged = _topk_fast(kind, extras, trained) if fast and not missing else None
        if merged is not None:
            out[name] = _map_arrays(merged, np.ndarray, _as_tensors)
            continue
        present = [i for i, e in enumerate(extras) if e is not None] if missing else range(len(extras))
        rows = np.fromiter(
            (len(extras[i].ids) if fast else len(extras[i]) for i in present), np.int64, count=len(present)
        )
        if (bad := np.flatnonzero(rows != trained[present])).size:
            i = present[int(bad[0])]
            sample = samples[i]
            raise ValueError(
                f"sample {i} ({sample.rollout_id or 'no rollout id'}) has {int(trained[i])} trained tokens but "
                f"{int(rows[bad[0]])} rows in token_extras[{name!r}] (one per trained token)"
            )
        if fast:
            merged = _concat_topk(kind, extras, trained)
        else:
            counts = trained.tolist()
            merged = kind.concat(
                [kind.empty(n) if e is None else e for e, n in zip(extras, counts, strict=True)]
            )
        out[name] = _map_arrays(merged, np.ndarray, _as_tensors)
    return out


def row_arrays(samples: Sequence[TrainingSequence], lengths: np.ndarray) -> tuple[list, list]:
    """(train masks, sampler log-probs) of a row's samples, whose ``input_ids`` have ``lengths``; ValueError
    naming the first sample whose mask or log-probs do not have one entry per input id."""
    n = len(samples)
    masks = [s.train_mask for s in samples]
    logprobs = [s.sampler_logprobs for s in samples]
    for name, arrays in (("train_mask", masks), ("sampler_logprobs", logprobs)):
        other = np.fromiter(map(len, arrays), dtype=np.int64, count=n)
        if (bad := np.flatnonzero(other != lengths)).size:
            raise ValueError(
                f"sample {bad[0]}: {name} has {other[bad[0]]} entries for {lengths[bad[0]]} input ids"
            )
    return masks, logprobs


def untrainable_first_token(sample: int) -> ValueError:
    return ValueError(f"sample {sample}: token 0 is marked trained but has no predecessor to predict it")


def gather_loss_terms(
    samples: Sequence[TrainingSequence],
    packed_positions: Sequence[np.ndarray] | np.ndarray | Callable[[np.ndarray], np.ndarray],
    input_ids: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
) -> dict[str, Any]:
    """Per-trained-token loss terms of ``samples``.

    ``packed_positions[s][i]`` is the packed row position of token ``i`` of sample ``s`` (or one flat array:
    every sample's positions one after another; or a function mapping flat token indices to positions, so only
    the predecessors of trained tokens are looked up). For each trained token ``t`` (``train_mask[t]``, t >= 1):
    ``pred_index = packed_positions[s][t - 1]``, ``target_ids = input_ids[t]``, plus the sample's sampler
    log-prob, advantage, index, candidate set (``support_ids``) and token extras (``extras``, by name). Returns the
    ``PackedRow`` loss fields (:func:`loss_terms`). ``input_ids``: the samples' ids one after another, when the
    packer has them already (then not concatenated again), and ``lengths`` their lengths. The row's arrays are
    concatenated once and indexed by the flat trained positions, so the cost is a few array operations per row plus
    attribute reads per sample.
    """
    n = len(samples)
    if lengths is None:
        lengths = np.fromiter((s.input_ids.shape[0] for s in samples), dtype=np.int64, count=n)
    masks, logprobs = row_arrays(samples, lengths)
    ends = np.cumsum(lengths)
    flat = np.flatnonzero(np.concatenate(masks)) if n else np.zeros(0, np.int64)
    owner = np.searchsorted(ends, flat, side="right")
    if (first := np.flatnonzero(flat == (ends - lengths)[owner])).size:
        raise untrainable_first_token(int(owner[first[0]]))
    trained = np.bincount(owner, minlength=n).astype(np.int64)
    if not n:
        pred = flat
    elif callable(packed_positions):
        pred = packed_positions(flat - 1)
    elif isinstance(packed_positions, np.ndarray):
        pred = packed_positions[flat - 1]
    else:
        pred = np.concatenate(packed_positions)[flat - 1]
    if input_ids is None and n:
        input_ids = np.concatenate([s.input_ids for s in samples])
    return loss_terms(samples, flat, pred, owner, trained, input_ids, logprobs)


def loss_terms(
    samples: Sequence[TrainingSequence],
    flat: np.ndarray,
    pred: np.ndarray,
    owner: np.ndarray,
    trained: np.ndarray,
    input_ids: np.ndarray | None,
    logprobs: list[np.ndarray],
) -> dict[str, Any]:
    """The ``PackedRow`` loss fields of a row whose trained tokens are the flat indices ``flat`` (the samples'
    tokens one after another), predicted at packed positions ``pred``, of samples ``owner`` (``trained``: per
    sample its count); ``input_ids``: the samples' ids one after another; ``logprobs``: their sampler log-probs."""
    out: dict[str, Any] = {}
    if samples:
        adv = np.array([s.advantage for s in samples])
        terms = {
            "pred_index": pred,
            "target_ids": input_ids[flat],
            "sampler_logprobs": np.concatenate(logprobs)[flat],
            "advantages": np.repeat(adv, trained),
            "sample_index": owner,
        }
    for name, dtype in _TERM_DTYPES.items():
        arr = terms[name].astype(dtype, copy=False) if samples else np.zeros(0, dtype=dtype)
        out[name] = _as_tensors(arr)
    out["support_ids"] = _support_ids(samples, trained)
    out["extras"] = _gather_extras(samples, trained)
    return out


_TERM_DTYPES = {
    "pred_index": np.int64,
    "target_ids": np.int64,
    "sampler_logprobs": np.float32,
    "advantages": np.float32,
    "sample_index": np.int64,
}
