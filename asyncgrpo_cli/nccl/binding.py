"""A small NCCL communicator over ctypes, without vLLM: the trainer's sending side and the embedded server's
receiving side of the ``nccl`` weight sync share it.

Rendezvous is vLLM's torch-free mode (``nccl_unique_id_b64``, vllm-rl-api.md 1.4; ``NCCLWeightTransferInitInfo``
accepts it in vLLM 0.32 and 0.33): rank 0 (the trainer) mints a 128-byte ``ncclUniqueId`` (NCCL's bootstrap root
listens on the trainer host; ``NCCL_SOCKET_IFNAME`` picks the interface) and sends it base64-encoded in
``init_info``; every rank then calls ``ncclCommInitRank`` concurrently (there is no store barrier) and, as vLLM's
``PyNcclCommunicator._init_comm`` does right after it, a one-element float32 sum ``all_reduce``: the warm-up
handshake every peer must match before any other collective, or all ranks deadlock.

NCCL calls cannot be interrupted, so every blocking wait here is bounded by the caller: ``connect`` runs the
rendezvous on a daemon thread and gives up after ``timeout``; ``abort`` (``ncclCommAbort``, also bounded) makes
kernels stuck on a peer that never comes return. libnccl is the one torch already loaded (``/proc/self/maps``),
else ``$ASYNCGRPO_NCCL_SO`` / ``$VLLM_NCCL_SO_PATH``, else the nvidia-nccl wheel, else ``libnccl.so.2``.

Self-check on a GPU host: ``python -m asyncgrpo_cli.nccl.binding`` (two ranks when two GPUs are visible).
"""

from __future__ import annotations

import base64
import ctypes
import glob
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

UNIQUE_ID_BYTES = 128
ABORT_TIMEOUT_S = 10.0

# ncclDataType_t (nccl.h): the values vLLM's pynccl_wrapper uses.
NCCL_DTYPES = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
NCCL_SUM = 0


class NcclError(RuntimeError):
    """An NCCL call failed, timed out or was aborted."""


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


_comm_t = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "ncclGetVersion": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetUniqueId": (ctypes.c_int, [ctypes.POINTER(NcclUniqueId)]),
    # ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId /* by value */, int rank)
    "ncclCommInitRank": (ctypes.c_int, [ctypes.POINTER(_comm_t), ctypes.c_int, NcclUniqueId, ctypes.c_int]),
    # ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, cudaStream_t)
    "ncclAllReduce": (
        ctypes.c_int,
        [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            _comm_t,
            ctypes.c_void_p,
        ],
    ),
    # ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, cudaStream_t)
    "ncclBroadcast": (
        ctypes.c_int,
        [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            _comm_t,
            ctypes.c_void_p,
        ],
    ),
    "ncclCommAbort": (ctypes.c_int, [_comm_t]),
}


def find_nccl_library() -> str:
    """The libnccl to load: an explicit path, the one torch loaded, the nvidia-nccl wheel's, or the soname."""
    for var in ("ASYNCGRPO_NCCL_SO", "VLLM_NCCL_SO_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    if torch.cuda.is_available():
        torch.cuda.init()  # libtorch_cuda links libnccl: it is mapped once CUDA is initialized
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libnccl.so"):
                    return path
    except OSError:  # not Linux
        pass
    for base in sys.path:
        found = sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnccl.so*")))
        if found:
            return found[0]
    return "libnccl.so.2"


class NcclLibrary:
    """The few libnccl entry points we call, with their C signatures."""

    _loaded: dict[str, NcclLibrary] = {}

    def __init__(self, path: str):
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as e:
            raise NcclError(
                f"cannot load the NCCL library {path!r} ({e}); set ASYNCGRPO_NCCL_SO to libnccl.so.2 "
                "(torch's CUDA wheels ship it in the nvidia-nccl package)"
            ) from e
        self.path = path
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._last_error = getattr(self.lib, "ncclGetLastError", None)  # NCCL >= 2.13
        if self._last_error is not None:
            self._last_error.restype, self._last_error.argtypes = ctypes.c_char_p, [_comm_t]

    @classmethod
    def get(cls) -> NcclLibrary:
        path = find_nccl_library()
        if path not in cls._loaded:
            cls._loaded[path] = cls(path)
        return cls._loaded[path]

    def check(self, result: int, what: str) -> None:
        if result == 0:
            return
        message = self.lib.ncclGetErrorString(result).decode(errors="replace")
        if self._last_error is not None:
            last = self._last_error(None)
            if last:
                message += f" ({last.decode(errors='replace')})"
        raise NcclError(f"{what} failed: NCCL error {result}: {message}")

    def version(self) -> str:
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        code = v.value  # 2.27.3 -> 22703
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES))

    def init_rank(self, unique_id: bytes, rank: int, world_size: int) -> int:
        uid = NcclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        comm = _comm_t()
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
        return int(comm.value)


class Communicator(Protocol):
    """What the weight transfer uses of a communicator (tests substitute an in-memory one)."""

    device: torch.device
    rank: int
    world_size: int
    aborted: bool

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None: ...

    def abort(self) -> None: ...


class NcclCommunicator:
    """One NCCL communicator on one CUDA device; the caller serializes its collectives."""

    def __init__(self, lib: NcclLibrary, comm: int, rank: int, world_size: int, device: torch.device):
        self.lib, self.comm = lib, ctypes.c_void_p(comm)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.aborted = False

    def _stream(self, stream: Any) -> ctypes.c_void_p:
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        return ctypes.c_void_p(stream.cuda_stream)

    def _check_tensor(self, tensor: torch.Tensor) -> int:
        if self.aborted:
            raise NcclError("the NCCL communicator was aborted (a failed or abandoned transfer)")
        if tensor.device != self.device or not tensor.is_contiguous():
            raise ValueError(f"NCCL needs a contiguous tensor on {self.device}, got {tensor.device}")
        try:
            return NCCL_DTYPES[tensor.dtype]
        except KeyError:
            raise ValueError(f"NCCL cannot send {tensor.dtype} tensors") from None

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        """Enqueue an in-place broadcast of ``tensor`` from rank ``src`` on ``stream`` (vLLM's pynccl semantics:
        the root passes its tensor as both buffers, the others a receive buffer)."""
        dtype = self._check_tensor(tensor)
        ptr = ctypes.c_void_p(tensor.data_ptr())
        send = ptr if self.rank == src else ctypes.c_void_p()
        result = self.lib.lib.ncclBroadcast(
            send, ptr, tensor.numel(), dtype, src, self.comm, self._stream(stream)
        )
        self.lib.check(result, "ncclBroadcast")

    def all_reduce(self, tensor: torch.Tensor, stream: Any = None) -> None:
        """In-place sum over the ranks."""
        dtype = self._check_tensor(tensor)
        ptr = ctypes.c_void_p(tensor.data_ptr())
        result = self.lib.lib.ncclAllReduce(
            ptr, ptr, tensor.numel(), dtype, NCCL_SUM, self.comm, self._stream(stream)
        )
        self.lib.check(result, "ncclAllReduce")

    def abort(self, timeout: float = ABORT_TIMEOUT_S) -> None:
        """``ncclCommAbort``: kernels waiting on a peer return and the communicator is unusable. Bounded: the
        call runs on a daemon thread (as in vLLM's ``PyNcclCommunicator.destroy``). Idempotent."""
        if self.aborted:
            return
        self.aborted = True
        lib, comm, index = self.lib, self.comm, self.device.index

        def run() -> None:
            with torch.cuda.device(index):
                lib.lib.ncclCommAbort(comm)

        thread = threading.Thread(target=run, name="nccl-abort", daemon=True)
        thread.start()
        thread.join(timeout)


def run_bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """``fn()`` on a daemon thread; its result, its exception, or ``TimeoutError`` after ``timeout`` seconds (the
    thread is then abandoned: NCCL calls cannot be interrupted)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name=f"bounded-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class NcclTransport:
    """Creates communicators: the real NCCL. Tests pass an in-memory transport with the same three methods."""

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"NCCL weight transfer needs a CUDA device; this side runs on {device}")

    def unique_id(self) -> bytes:
        return NcclLibrary.get().unique_id()

    def connect(self, unique_id: bytes, rank: int, world_size: int, device: torch.device) -> NcclCommunicator:
        """Join the group (every rank concurrently), then the one-element all_reduce warm-up vLLM's workers
        issue right after ``ncclCommInitRank``. Blocks until every rank has joined."""
        self.check_device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        lib = NcclLibrary.get()
        with torch.cuda.device(device):
            comm = NcclCommunicator(lib, lib.init_rank(unique_id, rank, world_size), rank, world_size, device)
            stream = torch.cuda.current_stream(device)
            warmup = torch.zeros(1, dtype=torch.float32, device=device)
            comm.all_reduce(warmup, stream)
            stream.synchronize()
        return comm


def encode_unique_id(unique_id: bytes) -> str:
    """Standard (not URL-safe) base64, as vLLM's ``nccl_unique_id_b64`` expects."""
    return base64.b64encode(unique_id).decode("ascii")


def decode_unique_id(text: Any) -> bytes:
    """Inverse of ``encode_unique_id``; ValueError naming the problem (vLLM's checks)."""
    if not isinstance(text, str) or not text:
        raise ValueError("nccl_unique_id_b64 is required: base64 of the 128-byte ncclUniqueId")
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise ValueError(
            "nccl_unique_id_b64 is not valid standard base64 (URL-safe base64 is not accepted)"
        ) from None
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"nccl_unique_id_b64 must decode to {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return raw


# -- self-check -------------------------------------------------------------------------------------------------
def _rank_one(unique_id: bytes, out: Any) -> None:
    try:
        device = torch.device("cuda", 1)
        torch.cuda.set_device(device)
        comm = NcclTransport().connect(unique_id, 1, 2, device)
        got = torch.empty(1000, dtype=torch.bfloat16, device=device)
        comm.broadcast(got, src=0)
        torch.cuda.synchronize(device)
        out.put(float(got.float().sum()))
    except BaseException as e:  # reported to the parent
        out.put(f"{type(e).__name__}: {e}")


def self_check() -> None:
    """Load libnccl, mint a unique id and, with two GPUs, broadcast between two processes."""
    import multiprocessing as mp

    lib = NcclLibrary.get()
    uid = NcclTransport().unique_id()
    print(f"libnccl {lib.version()} from {lib.path}; unique id {len(uid)} bytes")
    if torch.cuda.device_count() < 2:
        print("fewer than 2 CUDA devices: skipping the two-rank broadcast")
        return
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_rank_one, args=(uid, out), daemon=True)
    child.start()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    comm = run_bounded(lambda: NcclTransport().connect(uid, 0, 2, device), 120, "the two-rank rendezvous")
    sent = torch.arange(1000, device=device).to(torch.bfloat16)
    comm.broadcast(sent, src=0)
    torch.cuda.synchronize(device)
    got = out.get(timeout=120)
    child.join(30)
    want = float(sent.float().sum())
    if got != want:
        raise SystemExit(f"self-check FAILED: rank 1 got {got!r}, expected {want}")
    print(f"two-rank broadcast OK (rank 1 received sum {got})")


if __name__ == "__main__":
    self_check()
