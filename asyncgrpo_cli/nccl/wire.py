"""The data plane of one ``update_weights`` round, the same code on both sides: the tensor metadata that travels
in ``update_info``, the chunk plan, the sender's broadcasts and the receiver's unpacking.

Packed mode is vLLM's ``packed_tensor.py``: the raw bytes of consecutive tensors are concatenated into uint8
buffers, a chunk closes once its size *exceeds* ``buffer_size_bytes`` (so it holds at least one tensor and may
overshoot by its last one), and ``num_buffers`` CUDA streams rotate so that packing or unpacking one chunk
overlaps the broadcast of the next. Both sides derive the boundaries from the metadata alone (``plan_chunks``),
so they cannot disagree. Unpacked mode is vLLM's one-by-one path: one broadcast per tensor, in its own dtype.

Every host-side wait polls a CUDA event against a deadline, a stop flag and the communicator's abort flag, so a
peer that never arrives becomes an error instead of a hang; the caller then aborts the communicator.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo_cli.nccl.binding import NCCL_DTYPES, Communicator, NcclError

DEFAULT_BUFFER_SIZE_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES
DEFAULT_NUM_BUFFERS = 2  # vLLM's DEFAULT_PACKED_NUM_BUFFERS
POLL_S = 5e-5
DTYPES_BY_NAME = {str(d).removeprefix("torch."): d for d in NCCL_DTYPES}
UPDATE_INFO_KEYS = ("names", "dtype_names", "shapes")


@dataclass(frozen=True)
class TensorMeta:
    """One tensor as ``update_info`` announces it: HF checkpoint name, wire dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def update_info(metas: Sequence[TensorMeta]) -> dict[str, list]:
    """The ``update_info`` body of ``POST /update_weights`` (vLLM's ``NCCLWeightTransferUpdateInfo``)."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [str(m.dtype).removeprefix("torch.") for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def parse_update_info(info: Any) -> list[TensorMeta]:
    """Validate an ``update_info`` object (the checks vLLM makes, and well-formed names, dtypes and shapes)."""
    if not isinstance(info, dict):
        raise ValueError("update_info must be an object with names, dtype_names and shapes")
    unknown = sorted(set(info) - set(UPDATE_INFO_KEYS))
    if unknown:
        raise ValueError(f"update_info has unknown keys {unknown} (expected {', '.join(UPDATE_INFO_KEYS)})")
    names, dtype_names, shapes = (info.get(k, []) for k in UPDATE_INFO_KEYS)
    if not all(isinstance(v, list) for v in (names, dtype_names, shapes)):
        raise ValueError("update_info names, dtype_names and shapes must be lists")
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(
            f"update_info lists differ in length: {len(names)} names, {len(dtype_names)} dtype_names, "
            f"{len(shapes)} shapes"
        )
    metas = []
    for i, (name, dtype_name, shape) in enumerate(zip(names, dtype_names, shapes)):
        if not isinstance(name, str) or not name:
            raise ValueError(f"update_info names[{i}] must be a non-empty string, got {name!r}")
        if dtype_name not in DTYPES_BY_NAME:
            raise ValueError(
                f"update_info dtype_names[{i}] ({dtype_name!r}) is not one of {sorted(DTYPES_BY_NAME)}"
            )
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(
                f"update_info shapes[{i}] must be a list of non-negative integers, got {shape!r}"
            )
        metas.append(TensorMeta(name, DTYPES_BY_NAME[dtype_name], tuple(shape)))
    return metas


@dataclass(frozen=True)
class Chunk:
    """Tensors ``[start, stop)`` of the metadata, sent in one broadcast of ``nbytes`` bytes."""

    start: int
    stop: int
    nbytes: int


def plan_chunks(metas: Sequence[TensorMeta], packed: bool, buffer_size_bytes: int) -> list[Chunk]:
    """The broadcasts of one round. Packed: vLLM's rule, a chunk closes once its size exceeds the buffer size."""
    if not packed:
        return [Chunk(i, i + 1, m.nbytes) for i, m in enumerate(metas)]
    chunks: list[Chunk] = []
    start, size = 0, 0
    for i, meta in enumerate(metas):
        size += meta.nbytes
        if size > buffer_size_bytes:
            chunks.append(Chunk(start, i + 1, size))
            start, size = i + 1, 0
    if start < len(metas):
        chunks.append(Chunk(start, len(metas), size))
    return chunks


@dataclass(frozen=True)
class WireParams:
    """The must-agree wire parameters, fixed at ``init_weight_transfer_engine`` (vLLM's init_info fields)."""

    packed: bool = True
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES
    num_buffers: int = DEFAULT_NUM_BUFFERS

    def plan(self, metas: Sequence[TensorMeta]) -> list[Chunk]:
        return plan_chunks(metas, self.packed, self.buffer_size_bytes)


# -- streams and waits ------------------------------------------------------------------------------------------
@functools.cache
def _cuda_streams(device: torch.device, count: int) -> tuple[torch.cuda.Stream, ...]:
    """Cached like vLLM's ``_get_streams``: the caching allocator keys blocks by stream, fresh streams per round
    would strand the buffers' memory."""
    return tuple(torch.cuda.Stream(device=device) for _ in range(count))


def reset_streams() -> None:
    """Forget the cached streams after an aborted transfer: new work must not queue behind a kernel the abort may
    not have freed yet."""
    _cuda_streams.cache_clear()


def streams_for(device: torch.device, count: int) -> Sequence[torch.cuda.Stream | None]:
    """``count`` rotating CUDA streams on ``device``; ``None`` entries off CUDA (in-memory test transports)."""
    return _cuda_streams(device, count) if device.type == "cuda" else [None] * count


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class Fence:
    """Completion of the work enqueued on ``stream`` so far; keeps ``keep`` alive until then."""

    def __init__(self, stream: torch.cuda.Stream | None, keep: Any = None):
        self.keep = keep
        self.event: torch.cuda.Event | None = None
        if stream is not None:
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def done(self) -> bool:
        return self.event is None or self.event.query()


def wait_fence(
    fence: Fence | None, comm: Communicator, what: str, deadline: float | None, stop: threading.Event | None
) -> None:
    """Poll ``fence`` until done; raise when the deadline passes, ``stop`` is set or ``comm`` was aborted."""
    while fence is not None and not fence.done():
        if comm.aborted or (stop is not None and stop.is_set()):
            break
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete before the deadline (the peer is not taking part)")
        time.sleep(POLL_S)
    if comm.aborted:
        raise NcclError(f"{what}: the communicator was aborted")
    if stop is not None and stop.is_set():
        raise NcclError(f"{what}: stopped (the transfer failed elsewhere)")


# -- sender -----------------------------------------------------------------------------------------------------
def _checked(items: Iterable[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta]):
    """Pair each yielded tensor with its metadata, failing on the first disagreement: the receiver sizes its
    buffers and cuts its chunks from the metadata, so a mismatch would hang NCCL or load garbage."""
    it = iter(items)
    for i, meta in enumerate(metas):
        item = next(it, None)
        if item is None:
            raise ValueError(
                f"the model yielded {i} tensors but update_info declared {len(metas)} (next: {meta.name!r})"
            )
        name, tensor = item
        if name != meta.name or tensor.shape != meta.shape:
            raise ValueError(
                f"tensor {i} disagrees with update_info: declared {meta.name!r} {list(meta.shape)}, got {name!r} "
                f"{list(tensor.shape)}"
            )
        yield meta, tensor
    extra = next(it, None)
    if extra is not None:
        raise ValueError(
            f"the model yielded more tensors than update_info declared ({len(metas)}); first extra {extra[0]!r}"
        )


def _prepared(meta: TensorMeta, tensor: torch.Tensor, device: torch.device, stream: Any, transient: bool):
    """The tensor as it goes on the wire: on the communicator's device, in the declared dtype, contiguous."""
    if transient and stream is not None and tensor.device.type == "cuda":
        tensor.record_stream(stream)  # allocated on the caller's stream; read here after the caller drops it
    if tensor.device != device:
        tensor = tensor.to(device)
    if tensor.dtype != meta.dtype:
        tensor = tensor.to(meta.dtype)
    return tensor.contiguous()


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def send_tensors(
    comm: Communicator,
    items: Iterable[tuple[str, torch.Tensor]],
    metas: Sequence[TensorMeta],
    wire: WireParams,
    *,
    wait_for: torch.cuda.Stream | None = None,
    transient: bool = False,
    deadline: float | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Broadcast ``items`` (in ``metas`` order) from rank 0 and wait until every broadcast completed.

    ``wait_for``: the stream that produced the tensors (the training stream); every chunk waits for it.
    ``transient``: the tensors are freed by the caller after handing them over (FSDP2 gathers), so they are
    recorded on the stream that reads them.
    """
    streams = streams_for(comm.device, wire.num_buffers)
    fences: list[Fence | None] = [None] * len(streams)
    source = _checked(items, metas)
    for k, chunk in enumerate(wire.plan(metas)):
        slot = k % len(streams)
        wait_fence(fences[slot], comm, f"the broadcast of chunk {k - len(streams)}", deadline, stop)
        stream = streams[slot]
        with on_stream(stream):
            if wait_for is not None and stream is not None:
                stream.wait_stream(wait_for)
            pairs = list(itertools.islice(source, chunk.stop - chunk.start))
            tensors = [_prepared(m, t, comm.device, stream, transient) for m, t in pairs]
            data = _pack(tensors) if wire.packed else tensors[0]
            comm.broadcast(data, src=0, stream=stream)
            fences[slot] = Fence(stream, data)
    for _ in source:  # raises when the model has tensors update_info did not declare
        pass
    for fence in fences:
        wait_fence(fence, comm, "the last broadcasts", deadline, stop)


# -- receiver ---------------------------------------------------------------------------------------------------
def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """Views of a packed uint8 chunk as the announced tensors (vLLM's ``unpack_tensor``)."""
    out = []
    for meta, piece in zip(metas, buffer.split([m.nbytes for m in metas])):
        try:
            tensor = piece.view(meta.dtype)
        except RuntimeError:  # misaligned after an odd-sized tensor of a narrower dtype: copy out
            tensor = piece.clone().view(meta.dtype)
        out.append(tensor.view(meta.shape))
    return out


Loader = Callable[[list[tuple[TensorMeta, torch.Tensor]], Any], None]


def receive_tensors(
    comm: Communicator,
    metas: Sequence[TensorMeta],
    wire: WireParams,
    load: Loader,
    *,
    deadline: float | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Receive one round from rank 0. ``load(pairs, stream)`` is called per chunk right after its broadcast was
    enqueued on ``stream`` (stream order makes work it enqueues there wait for the data); returns once every
    chunk arrived and its load work completed."""
    streams = streams_for(comm.device, wire.num_buffers)
    fences: list[Fence | None] = [None] * len(streams)
    for k, chunk in enumerate(wire.plan(metas)):
        slot = k % len(streams)
        wait_fence(fences[slot], comm, f"receiving chunk {k - len(streams)}", deadline, stop)
        stream = streams[slot]
        part = metas[chunk.start : chunk.stop]
        with on_stream(stream):
            if wire.packed:
                data = torch.empty(chunk.nbytes, dtype=torch.uint8, device=comm.device)
                comm.broadcast(data, src=0, stream=stream)
                views = unpack(data, part)
            else:
                data = torch.empty(part[0].shape, dtype=part[0].dtype, device=comm.device)
                comm.broadcast(data, src=0, stream=stream)
                views = [data]
            load(list(zip(part, views)), stream)
            fences[slot] = Fence(stream, data)
    for fence in fences:
        wait_fence(fence, comm, "receiving the last chunks", deadline, stop)
