"""The embedded server's receiving side of vLLM's NCCL weight transfer (vllm-rl-api.md 1.3-1.4), on a GPU.

Routes, with vLLM's bodies and answers: ``/init_weight_transfer_engine {init_info}`` (the ``nccl_unique_id_b64``
rendezvous; blocks until the trainer joined), ``/start_weight_update``, ``/update_weights {update_info}`` (receives
the broadcast; returns once every tensor arrived), ``/finish_weight_update {weight_version}`` and
``/shutdown_weight_transfer_engine``. The server is one worker: rank ``rank_offset``.

Received tensors are copied into the model between engine steps (``GenerationEngine.apply_weights``, which also
drops the prefix cache); copies run on the receive streams and the engine's stream waits for them. A malformed
``update_info`` is refused (400) before any NCCL call; a broadcast that stops arriving fails after
``timeout`` seconds: the group is aborted and a new ``init`` is needed. On CPU every route answers 400.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from asyncgrpo_cli.embedded.api import ApiError
from asyncgrpo_cli.nccl.binding import Communicator, NcclTransport, decode_unique_id
from asyncgrpo_cli.nccl.wire import (
    TensorMeta,
    WireParams,
    on_stream,
    parse_update_info,
    receive_tensors,
    reset_streams,
)

RECEIVE_TIMEOUT_S = 600.0
INIT_INFO_KEYS = {
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "nccl_unique_id_b64",
    "packed",
    "packed_buffer_size_bytes",
    "packed_num_buffers",
}


def _conflict(message: str) -> ApiError:
    return ApiError(message, 409, "ConflictError")


def parse_init_info(info: Any) -> tuple[bytes, int, int, WireParams]:
    """(unique id, this worker's rank, world size, wire parameters) from vLLM's ``NCCLWeightTransferInitInfo``."""
    if not isinstance(info, dict):
        raise ApiError(
            "init_info must be an object (vLLM's NCCLWeightTransferInitInfo fields)", param="init_info"
        )
    unknown = sorted(set(info) - INIT_INFO_KEYS)
    if unknown:
        raise ApiError(f"init_info has unknown keys {unknown}", param="init_info")
    if info.get("master_address") is not None or info.get("master_port") is not None:
        raise ApiError(
            "the embedded server joins only by nccl_unique_id_b64 (the TCP-store rendezvous needs vLLM's "
            "StatelessProcessGroup); send nccl_unique_id_b64 without master_address/master_port",
            param="init_info",
        )
    try:
        uid = decode_unique_id(info.get("nccl_unique_id_b64"))
    except ValueError as e:
        raise ApiError(str(e), param="init_info.nccl_unique_id_b64") from None
    ints = {}
    for key, default in (
        ("rank_offset", None),
        ("world_size", None),
        ("packed_num_buffers", 2),
        ("packed_buffer_size_bytes", WireParams().buffer_size_bytes),
    ):
        value, least = info.get(key, default), 0 if key == "rank_offset" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ApiError(
                f"init_info.{key} must be an integer >= {least}, got {value!r}", param=f"init_info.{key}"
            )
        ints[key] = value
    rank, world = ints["rank_offset"], ints["world_size"]
    if rank >= world:
        raise ApiError(
            f"init_info.world_size ({world}) must exceed rank_offset ({rank}): this server is one worker"
        )
    packed = info.get("packed", False)  # vLLM's worker default when the trainer sends none
    if not isinstance(packed, bool):
        raise ApiError(f"init_info.packed must be a boolean, got {packed!r}", param="init_info.packed")
    return uid, rank, world, WireParams(packed, ints["packed_buffer_size_bytes"], ints["packed_num_buffers"])


class WeightReceiver:
    """Holds the NCCL group with the trainer and the state of the current update (one at a time)."""

    def __init__(self, engine: Any, *, transport: Any = None, timeout: float = RECEIVE_TIMEOUT_S):
        self.engine = engine
        self.device = next(engine.model.parameters()).device
        self.transport = transport or NcclTransport()
        self.timeout = timeout
        self._lock = threading.Lock()
        self._comm: Communicator | None = None
        self._wire = WireParams()
        self._started = False
        self._receiving: Communicator | None = None
        self._last_metas: list[TensorMeta] | None = None
        self._targets = dict(engine.model.state_dict(keep_vars=True))

    @property
    def communicator(self) -> Communicator | None:
        """The NCCL group with the trainer once joined (``asyncgrpo bench weight-sync`` times a raw broadcast)."""
        return self._comm

    @property
    def supported(self) -> bool:
        try:
            self.transport.check_device(self.device)
        except ValueError:
            return False
        return True

    def _check_device(self) -> None:
        try:
            self.transport.check_device(self.device)
        except ValueError as e:
            raise ApiError(
                f"{e}: NCCL weight transfer needs the embedded server on a GPU (server.embedded.device=cuda:N, "
                "another GPU than the trainer's), or server.weight_sync=disk"
            ) from None

    def _on_device(self) -> Any:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    # -- the routes' work ----------------------------------------------------------------------------------------
    def init(self, init_info: Any) -> None:
        self._check_device()
        uid, rank, world, wire = parse_init_info(init_info)
        with self._lock:
            old, self._comm, self._last_metas = self._comm, None, None
        if old is not None:
            old.abort()  # a receive stuck on the previous group returns
            reset_streams()
        try:
            comm = self._connect(uid, rank, world)
        except Exception as e:
            raise ApiError(
                f"the NCCL rendezvous failed: {type(e).__name__}: {e}", 500, "InternalServerError"
            ) from e
        with self._lock:
            self._comm, self._wire = comm, wire

    def _connect(self, uid: bytes, rank: int, world: int) -> Communicator:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                box["comm"] = self.transport.connect(uid, rank, world, self.device)
            except BaseException as e:  # reported below
                box["error"] = e

        thread = threading.Thread(target=run, name="nccl-rendezvous", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise TimeoutError(f"the trainer did not join within {self.timeout:g}s")
        if "error" in box:
            raise box["error"]
        return box["comm"]

    def start(self) -> None:
        self._check_device()
        with self._lock:
            if self._started:
                raise _conflict("a weight update is already started: POST /finish_weight_update first")
            self._started = True

    def update(self, update_info: Any) -> int:
        self._check_device()
        if isinstance(update_info, list):  # vLLM: one entry per worker rank; this server is one worker
            if len(update_info) != 1:
                raise ApiError(
                    f"update_info lists one entry per worker; this server has 1, got {len(update_info)}"
                )
            update_info = update_info[0]
        try:
            metas = parse_update_info(update_info)
        except ValueError as e:
            raise ApiError(str(e), param="update_info") from None
        with self._lock:
            if not metas:  # vLLM 0.33: empty lists reuse the previous round's metadata
                if self._last_metas is None:
                    raise ApiError("update_info is empty and no earlier update_weights gave the metadata")
                metas = self._last_metas
            self._check_targets(metas)
            if self._comm is None:
                raise ApiError("weight transfer is not initialized: POST /init_weight_transfer_engine first")
            if not self._started:
                raise _conflict("no weight update is started: POST /start_weight_update first")
            if self._receiving is not None:
                raise _conflict("another update_weights is receiving")
            comm = self._receiving = self._comm
            self._last_metas, wire = metas, self._wire
        try:
            with self._on_device():  # request threads start on CUDA's device 0
                receive_tensors(comm, metas, wire, self._load, deadline=time.monotonic() + self.timeout)
        except Exception as e:
            comm.abort()
            reset_streams()
            with self._lock:
                if self._comm is comm:
                    self._comm = None
            raise ApiError(
                f"receiving the weights failed ({type(e).__name__}: {e}); the NCCL group is closed, the model "
                "may hold partially updated weights: POST /init_weight_transfer_engine again",
                500,
                "InternalServerError",
            ) from e
        finally:
            with self._lock:
                self._receiving = None
        return len(metas)

    def _check_targets(self, metas: list[TensorMeta]) -> None:
        problems = []
        for m in metas:
            target = self._targets.get(m.name)
            if target is None:
                problems.append(f"{m.name!r} is not a tensor of the served model")
            elif tuple(target.shape) != m.shape:
                problems.append(f"{m.name!r} has shape {list(m.shape)}, the model's is {list(target.shape)}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise ApiError(
                "update_info does not match the served model: " + "; ".join(problems[:5]) + more,
                param="update_info",
            )

    def _load(self, pairs: list[tuple[TensorMeta, torch.Tensor]], stream: Any) -> None:
        """Copy one chunk into the model between engine steps, on the chunk's stream (after its broadcast)."""
        dst = [self._targets[m.name] for m, _ in pairs]
        src = [t for _, t in pairs]

        def copy(model: Any) -> None:
            engine_stream = torch.cuda.default_stream(self.device) if stream is not None else None
            with torch.no_grad(), on_stream(stream):
                if stream is not None:
                    stream.wait_stream(engine_stream)  # nothing of the engine still reads these weights
                torch._foreach_copy_(dst, src)
            if stream is not None:
                engine_stream.wait_stream(stream)  # the next forward sees the new weights

        self.engine.apply_weights(copy)

    def finish(self) -> None:
        self._check_device()
        with self._lock:
            if not self._started:
                raise _conflict("no weight update is started: POST /start_weight_update first")
            self._started = False
            receiving = self._receiving
        if receiving is not None:  # the trainer gave up on a transfer: stop receiving it
            receiving.abort()

    def shutdown(self) -> None:
        with self._lock:
            if self._receiving is not None:
                raise _conflict("refused during an update_weights")
            comm, self._comm, self._last_metas = self._comm, None, None
        if comm is not None:
            comm.abort()


# -- routes -----------------------------------------------------------------------------------------------------
def _body(raw: bytes) -> dict[str, Any]:
    import json

    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object")
    return data


def init_weight_transfer_engine(app: Any, query: dict[str, str], body: bytes) -> tuple[int, Any]:
    req = _body(body)
    if "init_info" not in req:
        raise ApiError("init_info is required", param="init_info")
    app.weight_transfer.init(req["init_info"])
    return 200, {"message": "Weight transfer initialized"}


def start_weight_update(app: Any, query: dict[str, str], body: bytes) -> tuple[int, Any]:
    app.weight_transfer.start()
    return 200, {"message": "Weight update started"}


def update_weights(app: Any, query: dict[str, str], body: bytes) -> tuple[int, Any]:
    req = _body(body)
    if "update_info" not in req:
        raise ApiError("update_info is required", param="update_info")
    app.weight_transfer.update(req["update_info"])
    return 200, {"message": "Weights updated"}


def finish_weight_update(app: Any, query: dict[str, str], body: bytes) -> tuple[int, Any]:
    version = _body(body).get("weight_version")
    app.weight_transfer.finish()
    if version is not None:
        app.weight_version = str(version)
    return 200, {"message": "Weight update finished"}


def shutdown_weight_transfer_engine(app: Any, query: dict[str, str], body: bytes) -> tuple[int, Any]:
    app.weight_transfer.shutdown()
    return 200, {"message": "Weight transfer shut down"}


ROUTES = {
    ("POST", "/init_weight_transfer_engine"): init_weight_transfer_engine,
    ("POST", "/start_weight_update"): start_weight_update,
    ("POST", "/update_weights"): update_weights,
    ("POST", "/finish_weight_update"): finish_weight_update,
    ("POST", "/shutdown_weight_transfer_engine"): shutdown_weight_transfer_engine,
}
