"""``nccl`` weight sync: vLLM's native weight transfer (vllm-rl-api.md 1.4) from the trainer's GPU, without vLLM.

Init, once (again after a failed transfer or a server restart): rank 0 mints an NCCL unique id, then POSTs
``/init_weight_transfer_engine {init_info: {nccl_unique_id_b64, rank_offset: 1, world_size, packed,
packed_buffer_size_bytes, packed_num_buffers}}`` on a thread while it joins the group as rank 0; the server
answers once every rank joined. Both are bounded by ``server.nccl.init_timeout``.

Each push, on rank 0: ``/pause?mode=keep`` -> ``/start_weight_update`` -> ``/update_weights {update_info}`` (with
``server.nccl.timeout``) while a daemon thread broadcasts the tensors in exactly that order, contiguous, in the
served dtype (``/server_info``), tied ``lm_head.weight`` left out -> ``/finish_weight_update {weight_version}`` ->
``/resume``. A failed transfer aborts the NCCL group (a broadcast stuck on a peer returns), sends a best-effort
finish, resumes, and raises ``NcclSyncError`` naming the phase; the next push initializes a new group.

Several FSDP2 ranks: every rank gathers each full tensor in lockstep on its training thread; rank 0 hands them to
the broadcast thread through a 2-deep queue while ``/update_weights`` runs on a helper thread, and rank 0's
verdict is broadcast so that every rank raises together.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from asyncgrpo_cli.config.schema import NcclSyncConfig, RootConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.model.loading import checkpoint_name
from asyncgrpo_cli.nccl.binding import Communicator, NcclTransport, encode_unique_id
from asyncgrpo_cli.nccl.wire import TensorMeta, WireParams, reset_streams, send_tensors, update_info
from asyncgrpo_cli.rollout.resync import server_unreachable
from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.sync.base import BaseWeightSync
from asyncgrpo_cli.sync.writer import tied_skip
from asyncgrpo_cli.train.distributed import DistInfo, broadcast_object, iter_full_state

log = logging.getLogger(__name__)

QUEUE_DEPTH = 2
POLL_S = 0.01
_DONE = object()


class NcclSyncError(RuntimeError):
    """A weight transfer failed; the message names the phase and what to check."""


class _Call(threading.Thread):
    """``fn()`` on a daemon thread, its result or exception kept for the caller."""

    def __init__(self, fn: Callable[[], Any], name: str):
        super().__init__(name=name, daemon=True)
        self.fn, self.value, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # handed to the caller
            self.error = e

    @property
    def done(self) -> bool:
        return not self.is_alive()


def _full_tensors(model: Any, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` in state-dict order where the tensor lives (no CPU round trip, unlike
    ``iter_full_state``, which writes to disk); an FSDP2 shard is gathered with ``full_tensor()`` in the same order
    as ``iter_full_state`` on the other ranks."""
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict().items():
        if name not in skip:
            yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _device_of(model: Any) -> torch.device:
    device = next(model.parameters()).device
    if device.type != "cuda" and torch.cuda.is_available():  # CPU-offloaded FSDP2 shards: the rank's GPU
        return torch.device("cuda", torch.cuda.current_device())
    return device


class NcclWeightSync(BaseWeightSync):
    """Every rank calls ``push`` (FSDP2 gathers are collectives); rank 0 holds ``control`` and the NCCL group.

    ``transport`` creates communicators; tests pass an in-memory one (the default is the real NCCL).
    """

    def __init__(
        self,
        control: ServerControl | None,
        directory: Path | None = None,
        info: DistInfo | None = None,
        cfg: NcclSyncConfig | None = None,
        *,
        transport: Any = None,
    ):
        self.control = control
        self.info = info or DistInfo()
        self.cfg = cfg or NcclSyncConfig()
        if self.cfg.num_buffers < 1 or self.cfg.buffer_size_bytes < 1:
            raise UserError("server.nccl.num_buffers and server.nccl.buffer_size_bytes must be >= 1")
        self.wire = WireParams(self.cfg.packed, self.cfg.buffer_size_bytes, self.cfg.num_buffers)
        self.transport = transport or NcclTransport()
        self._comm: Communicator | None = None
        self._served: torch.dtype | None = None
        self._version: str | None = None  # what the server reports after our last finish_weight_update

    @property
    def communicator(self) -> Communicator | None:
        """The NCCL group with the server once joined (``asyncgrpo bench weight-sync`` times a raw broadcast)."""
        return self._comm

    @classmethod
    def build(
        cls, cfg: RootConfig, control: ServerControl | None, directory: Path, info: DistInfo
    ) -> NcclWeightSync:
        """Built by ``train``: the settings under ``server.nccl``."""
        return cls(control, directory, info, cfg.server.nccl)

    # -- the push --------------------------------------------------------------------------------------------------
    def push(self, model: Any, version: int) -> dict[str, float]:
        """Send the model's weights as ``version``; returns the phase timings in seconds (rank 0)."""
        skip = tied_skip(model)
        if not self.info.is_main:
            for _ in iter_full_state(model, self.info, skip):  # lockstep gathers; rank 0 broadcasts
                pass
            message = broadcast_object(None, self.info)
            if message is not None:
                raise NcclSyncError(message)
            return {}
        if not self.info.enabled:
            return self._push_main(model, version, skip)
        try:
            timings = self._push_main(model, version, skip)
        except Exception as e:
            broadcast_object(f"rank 0: {e}", self.info)
            if isinstance(e, NcclSyncError):
                raise
            raise NcclSyncError(str(e)) from e  # every rank stops alike (no resync deferral on rank 0 alone)
        broadcast_object(None, self.info)
        return timings

    def _push_main(self, model: Any, version: int, skip: set[str]) -> dict[str, float]:
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        gathered = _full_tensors(model, skip) if self.info.enabled else None
        try:
            device = _device_of(model)
            if self._needs_init():
                self._init(device)
                timings["perf/weight_sync_init_s"] = time.monotonic() - t0
            metas = self._metas(model, skip)
            t_pause = time.monotonic()
            self.control.pause(mode="keep")
            timings["perf/weight_sync_pause_s"] = time.monotonic() - t_pause
        except BaseException:
            _drain(gathered)  # the other ranks gather every tensor: take part before raising
            raise
        try:
            timings["perf/weight_sync_transfer_s"] = self._update(model, metas, version, skip, gathered)
        except BaseException:
            self._quietly(self.control.resume)
            raise
        self.control.resume()
        timings["perf/weight_sync_s"] = time.monotonic() - t0
        return timings

    def _update(self, model: Any, metas: list[TensorMeta], version: int, skip: set[str], gathered) -> float:
        """start -> update_weights while the broadcast runs -> finish; on failure abort, finish, raise."""
        phase, started = "start_weight_update", False
        try:
            self.control.start_weight_update()
            started = True
            phase = "update_weights"
            t0 = time.monotonic()
            self._transfer(model, metas, skip, gathered)
            took = time.monotonic() - t0
            phase = "finish_weight_update"
            self.control.finish_weight_update(f"v{version}")
            self._version = f"v{version}"
            return took
        except BaseException as e:
            _drain(gathered)
            self._drop_comm()
            if started and phase != "finish_weight_update":
                self._quietly(self.control.finish_weight_update)
            if isinstance(e, NcclSyncError) or not isinstance(e, Exception):
                raise
            if phase != "update_weights" and server_unreachable(e):
                raise  # the server is gone: the trainer pushes again once it is back (rollout.resync)
            raise NcclSyncError(
                f"NCCL weight sync of version v{version} failed at {phase}: {e}. The server may serve partially "
                "updated weights until the next sync, which opens a new NCCL group. Check the server's log; "
                "raise server.nccl.timeout if the transfer is only slow."
            ) from e

    def _transfer(self, model: Any, metas: list[TensorMeta], skip: set[str], gathered) -> None:
        """POST /update_weights (bounded by server.nccl.timeout) while a daemon thread broadcasts."""
        comm = self._comm
        deadline = time.monotonic() + self.cfg.timeout
        stop = threading.Event()
        cuda = comm.device.type == "cuda"
        caller = torch.cuda.current_stream(comm.device) if cuda else None
        feed: queue.Queue | None = None if gathered is None else queue.Queue(QUEUE_DEPTH)
        items: Iterable = _full_tensors(model, skip) if feed is None else _from_queue(feed, stop)

        def broadcast() -> None:
            if cuda:
                torch.cuda.set_device(comm.device)
            send_tensors(
                comm,
                items,
                metas,
                self.wire,
                wait_for=caller,
                transient=gathered is not None,
                deadline=deadline,
                stop=stop,
            )

        sender = _Call(broadcast, "nccl-broadcast")
        body = update_info(metas)
        try:
            if gathered is None:  # one rank: the training thread is free for the HTTP call
                self.control.update_weights(body, timeout=self.cfg.timeout)
            else:  # several ranks: the training thread gathers in lockstep, the HTTP call runs beside it
                http = _Call(
                    lambda: self.control.update_weights(body, timeout=self.cfg.timeout), "nccl-update"
                )
                _feed(feed, gathered, lambda: sender.done or http.error is not None, deadline)
                http.join(max(0.0, deadline - time.monotonic()) + 5.0)
                if http.error is not None:
                    raise http.error
                if not http.done:
                    raise TimeoutError(
                        f"POST /update_weights did not answer within server.nccl.timeout={self.cfg.timeout:g}s"
                    )
        except BaseException as e:
            stop.set()
            if sender.error is not None:
                raise NcclSyncError(
                    f"the broadcast failed ({sender.error}); the server then answered: {e}"
                ) from e
            raise
        sender.join(max(0.0, deadline - time.monotonic()))
        if sender.error is not None:
            raise NcclSyncError(
                f"the broadcast failed after the server took the update: {sender.error}"
            ) from sender.error
        if not sender.done:
            stop.set()
            raise TimeoutError(
                f"the broadcast did not finish within server.nccl.timeout={self.cfg.timeout:g}s"
            )

    # -- init ------------------------------------------------------------------------------------------------------
    def _needs_init(self) -> bool:
        if self._comm is None:
            return True
        if self._version is not None and self.control.weight_version() not in (self._version, None):
            log.warning(
                "the server no longer holds weight version %s (a restart?): joining it again", self._version
            )
            self._drop_comm()
            return True
        return False

    def _init(self, device: torch.device) -> None:
        """The rendezvous: POST /init_weight_transfer_engine on a thread while rank 0 joins; both bounded."""
        try:
            self.transport.check_device(device)
        except ValueError as e:
            raise UserError(f"server.weight_sync=nccl: {e}. Train on a GPU (trainer.device=cuda).") from None
        world = 1 + self.control.world_size()
        uid = self.transport.unique_id()
        init_info = {
            "nccl_unique_id_b64": encode_unique_id(uid),
            "rank_offset": 1,
            "world_size": world,
            "packed": self.wire.packed,
            "packed_buffer_size_bytes": self.wire.buffer_size_bytes,
            "packed_num_buffers": self.wire.num_buffers,
        }
        timeout = self.cfg.init_timeout
        http = _Call(
            lambda: self.control.init_weight_transfer_engine(init_info, timeout=timeout), "nccl-init-http"
        )
        join = _Call(lambda: self.transport.connect(uid, 0, world, device), "nccl-init")
        deadline = time.monotonic() + timeout
        while not (http.done and join.done):
            failed = http.error or join.error
            if failed is not None or time.monotonic() > deadline:
                if join.done and join.error is None:
                    join.value.abort()
                why = failed or TimeoutError(f"not complete within server.nccl.init_timeout={timeout:g}s")
                raise NcclSyncError(
                    f"the NCCL rendezvous with the server (world size {world}) failed: {why}"
                ) from failed
            time.sleep(POLL_S)
        if http.error is not None or join.error is not None:
            if join.error is None:
                join.value.abort()
            why = http.error or join.error
            raise NcclSyncError(
                f"the NCCL rendezvous with the server (world size {world}) failed: {why}"
            ) from why
        self._comm, self._version = join.value, None
        self._served = self._served_dtype()
        log.info(
            "NCCL weight transfer: joined the server's %d worker(s) from %s (%s, %s)",
            world - 1,
            device,
            "packed" if self.wire.packed else "unpacked",
            self._served or "trainer dtype",
        )

    def _served_dtype(self) -> torch.dtype | None:
        """The server's dtype (``/server_info``): floating tensors are cast to it before they are sent."""
        from asyncgrpo_cli.server.report import server_config
        from asyncgrpo_cli.sync.verify import dtype_name

        name = dtype_name(server_config(self.control).get("model_config", {}).get("dtype"))
        return getattr(torch, name) if name else None

    def _metas(self, model: Any, skip: set[str]) -> list[TensorMeta]:
        out = []
        for name, tensor in model.state_dict().items():  # DTensor shapes are global: no gather needed
            if name in skip:
                continue
            dtype = self._served if self._served is not None and tensor.is_floating_point() else tensor.dtype
            out.append(TensorMeta(checkpoint_name(model, name), dtype, tuple(tensor.shape)))
        return out

    # -- teardown --------------------------------------------------------------------------------------------------
    def _drop_comm(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()
            reset_streams()

    @staticmethod
    def _quietly(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # best effort while another error is raised
            log.warning("%s failed while handling a weight-sync error: %s", getattr(fn, "__name__", fn), e)

    def close(self) -> None:
        if self.info.is_main and self._comm is not None:
            self._quietly(self.control.shutdown_weight_transfer_engine)
        self._drop_comm()


def _from_queue(feed: queue.Queue, stop: threading.Event) -> Iterator[Any]:
    while True:
        try:
            item = feed.get(timeout=0.1)
        except queue.Empty:
            if stop.is_set():
                raise NcclSyncError("stopped while waiting for gathered tensors") from None
            continue
        if item is _DONE:
            return
        yield item


def _feed(feed: queue.Queue, gathered: Iterator, failed: Callable[[], bool], deadline: float) -> None:
    """Rank 0's training thread: every gather happens (lockstep with the other ranks); the tensors reach the
    broadcast thread until the transfer failed, then they are dropped."""
    for item in gathered:
        _put(feed, item, failed, deadline)
    _put(feed, _DONE, failed, deadline)


def _put(feed: queue.Queue, item: Any, failed: Callable[[], bool], deadline: float) -> None:
    while not failed() and time.monotonic() < deadline:
        try:
            feed.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _drain(gathered: Iterator | None) -> None:
    if gathered is not None:
        for _ in gathered:
            pass
