"""A scored group's samples as one message from the rollout process to the trainer, stored column by column.

Why by hand: the rollout queue (a ``multiprocessing.Queue``) pickles every item it carries. A
``TrainingSequence`` pickled alone costs the trainer ~20 us to unpickle (numpy rebuilds each of its arrays and
their dtypes one by one, ~3 us an array) plus ~10 us of lock and pipe reads per message: ~30 us a sample, more
than planning and packing it together (``docs/benchmarks.md``, ``asyncgrpo bench transport``), and all of it on
rank 0, which takes every rank's samples. A :class:`SampleBatch` carries a group's samples as one message whose
arrays are concatenated field by field (a handful of arrays per group instead of ~5 per sample); the trainer gets
back plain ``TrainingSequence`` objects whose arrays are views of those columns (writable, equal in dtype, shape
and values to the ones sent). No library does this for dataclasses of numpy arrays: pickle's out-of-band buffers
still rebuild every array, and the queue itself is the standard library's.

What is stored as columns: ``input_ids``, ``train_mask``, ``sampler_logprobs`` (each of one dtype across the
group), and every token extra that all samples carry with the same dataclass type and, field by field, arrays of
one dtype and trailing shape (``TopK``, ``TeacherTopK``, a user's extra of that shape); the extra's other fields
travel per sample. Everything else (``sampling_mask``, the scalars, an extra of another shape) is pickled per
sample as before. A group that does not fit this (arrays of different dtypes, a field that is not an array) is
sent as a plain list: nothing is ever converted.
"""

from __future__ import annotations

import queue
from collections import deque
from dataclasses import fields, is_dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from asyncgrpo_cli.samples import TrainingSequence

_CORE = ("input_ids", "train_mask", "sampler_logprobs")
_FIELDS = tuple(f.name for f in fields(TrainingSequence))
_EXTRAS_AT = _FIELDS.index("token_extras")
_REST = tuple(name for name in _FIELDS if name not in _CORE and name != "token_extras")
"""The fields sent per sample, in field order (``_decode`` builds samples positionally: the core arrays are the
first fields, ``tests/test_sample_batch.py`` round-trips every field)."""


class SampleBatch:
    """The samples of one scored group on their way to the trainer (one queue message; module docstring).

    Example:
        >>> import pickle
        >>> s = TrainingSequence(np.array([1, 2, 3]), np.array([0, 1, 1], bool), np.zeros(3, np.float32))
        >>> back = pickle.loads(pickle.dumps(SampleBatch([s, s]))).samples
        >>> len(back), back[1].input_ids.tolist(), back[1].input_ids.flags.writeable
        (2, [1, 2, 3], True)
    """

    __slots__ = ("samples",)

    def __init__(self, samples: list[TrainingSequence]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __reduce__(self) -> tuple:
        encoded = _encode(self.samples)
        return (SampleBatch, (self.samples,)) if encoded is None else (_decode, encoded)


def _column(arrays: list[Any]) -> tuple[np.ndarray, list[int]] | None:
    """(the arrays concatenated, their first-dimension offsets) when they are numpy arrays of one dtype and one
    trailing shape, else None."""
    first = arrays[0]
    if type(first) is not np.ndarray or first.ndim == 0:
        return None
    dtype, tail = first.dtype, first.shape[1:]
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype != dtype or a.ndim == 0 or a.shape[1:] != tail:
            return None
    return np.concatenate(arrays), [0, *accumulate(a.shape[0] for a in arrays)]


def _extra_columns(name: str, values: list[Any]) -> tuple | None:
    """One token extra of every sample as (name, class, array columns, per-sample other fields), or None when
    it is not stored as columns (module docstring)."""
    kind = type(values[0])
    if not is_dataclass(kind) or any(type(v) is not kind for v in values):
        return None
    columns, others = {}, {}
    for f in fields(kind):
        if not f.init:
            return None
        items = [getattr(v, f.name) for v in values]
        if type(items[0]) is np.ndarray:
            column = _column(items)
            if column is None:
                return None
            columns[f.name] = column
        elif any(type(x) is np.ndarray for x in items):
            return None
        else:
            others[f.name] = items
    return name, kind, columns, others


def _encode(samples: list[TrainingSequence]) -> tuple | None:
    """The arguments of :func:`_decode`, or None when the group is sent as a plain list."""
    if not samples or any(type(s) is not TrainingSequence for s in samples):
        return None
    core = [_column([getattr(s, name) for s in samples]) for name in _CORE]
    if any(c is None for c in core):
        return None
    names = tuple(samples[0].token_extras)
    extras: list[tuple] | None = None
    if all(tuple(s.token_extras) == names for s in samples):
        extras = [_extra_columns(n, [s.token_extras[n] for s in samples]) for n in names]
        if any(e is None for e in extras):
            extras = None
    per_sample_extras = None if extras is not None else [s.token_extras for s in samples]
    rest = [tuple(getattr(s, name) for name in _REST) for s in samples]
    return len(samples), core, extras, per_sample_extras, rest


def _decode(
    n: int,
    core: list[tuple[np.ndarray, list[int]]],
    extras: list[tuple] | None,
    per_sample_extras: list[dict] | None,
    rest: list[tuple],
) -> SampleBatch:
    """The batch :func:`_encode` described: samples whose arrays are views of the columns."""
    (ids, ids_at), (mask, mask_at), (lps, lps_at) = ((_canonical(c), at) for c, at in core)
    if extras is None:
        token_extras = per_sample_extras
    else:
        token_extras = [{} for _ in range(n)]
        for name, kind, columns, others in extras:
            columns = {f: (_canonical(col), at) for f, (col, at) in columns.items()}
            for i in range(n):
                kwargs = {f: col[at[i] : at[i + 1]] for f, (col, at) in columns.items()}
                for f, values in others.items():
                    kwargs[f] = values[i]
                token_extras[i][name] = kind(**kwargs)
    cut = _EXTRAS_AT - len(_CORE)  # fields in ``rest`` before token_extras
    return SampleBatch(
        [
            TrainingSequence(
                ids[ids_at[i] : ids_at[i + 1]],
                mask[mask_at[i] : mask_at[i + 1]],
                lps[lps_at[i] : lps_at[i + 1]],
                *r[:cut],
                token_extras[i],
                *r[cut:],
            )
            for i, r in enumerate(rest)
        ]
    )


def _canonical(column: np.ndarray) -> np.ndarray:
    """``column`` with numpy's own dtype object for its type: an unpickled array carries a dtype equal to
    ``np.dtype(np.bool_)`` but not that object, so an identity test of its dtype fails (the tree planner's once
    did, and counted every sample's trained tokens in Python). A dtype numpy has no such object for stays."""
    dtype = column.dtype
    if dtype.kind not in "biufc" or (own := np.dtype(dtype.type)) is dtype or own != dtype:
        return column
    return column.view(own)


class QueueReader:
    """The trainer's end of the rollout queue: items one at a time, a :class:`SampleBatch` sample by sample in
    order, so a consumer sees the stream it saw when every sample was its own message; with ``group=True`` the
    samples come as a list: what is left of their batch (a lone sample: a list of one). ``put_back`` returns samples
    not used to the front, in order. ``get`` / ``get_nowait`` raise ``queue.Empty`` like the queue's; ``taken``:
    samples handed out and not put back."""

    def __init__(self, source: Any) -> None:
        self._queue = source
        self._pending: deque[TrainingSequence] = deque()
        self.taken = 0

    def get(self, timeout: float, group: bool = False) -> Any:
        return self._next(group) if self._pending else self._unpack(self._queue.get(timeout=timeout), group)

    def get_nowait(self, group: bool = False) -> Any:
        return self._next(group) if self._pending else self._unpack(self._queue.get_nowait(), group)

    def put_back(self, samples: list[TrainingSequence]) -> None:
        """``samples`` (the last ones handed out, in order) are handed out again next, before anything else."""
        self._pending.extendleft(reversed(samples))
        self.taken -= len(samples)

    def _unpack(self, item: Any, group: bool) -> Any:
        if type(item) is not SampleBatch:
            if isinstance(item, TrainingSequence):
                self.taken += 1
                return [item] if group else item
            return item
        self._pending.extend(item.samples)
        if not self._pending:  # an empty batch carries nothing: read on
            raise queue.Empty
        return self._next(group)

    def _next(self, group: bool) -> TrainingSequence | list[TrainingSequence]:
        if not group:
            self.taken += 1
            return self._pending.popleft()
        samples = list(self._pending)
        self._pending.clear()
        self.taken += len(samples)
        return samples
