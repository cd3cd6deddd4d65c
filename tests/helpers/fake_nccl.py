"""Stand-ins for NCCL and for a vLLM server's weight-transfer routes, for CPU tests of the ``nccl`` weight sync.

- ``LoopbackTransport``: communicators of one process exchange tensors through queues. ``connect`` blocks until
  every rank of a unique id joined (as ``ncclCommInitRank`` does); a broadcast hands the root's bytes to every
  other rank, and a receiver whose buffer disagrees with what was sent fails (real NCCL would hang or load
  garbage). The root records every broadcast's dtype and element count.
- ``HangingTransport``: a peer that never arrives. Its root's broadcast blocks until ``abort`` (or, with
  ``ignore_abort``, for good: a wedged NCCL call).
- ``FakeTransferServer``: ``FakeVllmServer`` plus vLLM's pause/resume and weight-transfer routes, with faults:
  ``update_status`` answers update_weights with an error, ``hang_update`` never answers it.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from typing import Any

import torch

from asyncgrpo_cli.nccl.binding import NcclError
from tests.helpers.fake_server import FakeVllmServer

WAIT_S = 30.0


class _Group:
    def __init__(self, world: int):
        self.world = world
        self.joined = 0
        self.cond = threading.Condition()
        self.inboxes = {rank: queue.Queue() for rank in range(world)}


class LoopbackComm:
    def __init__(self, group: _Group, rank: int, device: torch.device):
        self.group, self.rank, self.world_size, self.device = group, rank, group.world, device
        self.aborted = False
        self.sent: list[tuple[torch.dtype, int]] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        if self.aborted:
            raise NcclError("aborted")
        if self.rank == src:
            self.sent.append((tensor.dtype, tensor.numel()))
            for rank, inbox in self.group.inboxes.items():
                if rank != src:
                    inbox.put(tensor.detach().clone())
            return
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                data = self.group.inboxes[self.rank].get(timeout=0.02)
                break
            except queue.Empty:
                if self.aborted:
                    raise NcclError("aborted while receiving") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("no broadcast arrived") from None
        if data.dtype != tensor.dtype or data.numel() != tensor.numel():
            raise RuntimeError(
                f"mismatched broadcast: sent {data.dtype} x {data.numel()}, receiving {tensor.dtype} x {tensor.numel()}"
            )
        tensor.view(-1).copy_(data.view(-1))

    def abort(self) -> None:
        self.aborted = True


class LoopbackTransport:
    _groups: dict[bytes, _Group] = {}
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.comms: list[LoopbackComm] = []

    def check_device(self, device: torch.device) -> None:
        pass

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def connect(self, unique_id: bytes, rank: int, world_size: int, device: torch.device) -> LoopbackComm:
        with self._lock:
            group = self._groups.setdefault(unique_id, _Group(world_size))
        with group.cond:
            group.joined += 1
            group.cond.notify_all()
            if not group.cond.wait_for(lambda: group.joined >= group.world, timeout=WAIT_S):
                raise TimeoutError("the other ranks never joined")
        comm = LoopbackComm(group, rank, device)
        self.comms.append(comm)
        return comm


class HangingComm:
    def __init__(self, device: torch.device, ignore_abort: bool):
        self.rank, self.world_size, self.device = 0, 2, device
        self.aborted = False
        self.ignore_abort = ignore_abort
        self._released = threading.Event()
        self.entered = threading.Event()

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        if self.aborted:
            raise NcclError("aborted")
        self.entered.set()
        self._released.wait(WAIT_S * 10 if self.ignore_abort else WAIT_S)
        raise NcclError("aborted while broadcasting")

    def abort(self) -> None:
        self.aborted = True
        if not self.ignore_abort:
            self._released.set()


class HangingTransport:
    def __init__(self, ignore_abort: bool = False):
        self.ignore_abort = ignore_abort
        self.comms: list[HangingComm] = []

    def check_device(self, device: torch.device) -> None:
        pass

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def connect(self, unique_id: bytes, rank: int, world_size: int, device: torch.device) -> HangingComm:
        comm = HangingComm(device, self.ignore_abort)
        self.comms.append(comm)
        return comm


class FakeTransferServer(FakeVllmServer):
    """A vLLM server's control and weight-transfer routes, without any NCCL behind them."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.update_status = 200
        self.hang_update = threading.Event()  # set: update_weights never answers (until release())
        self._release = threading.Event()
        self.paused = False
        self.bodies: dict[str, list[Any]] = {}

    def release(self) -> None:
        self._release.set()

    def _answer(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        status, payload = super()._answer(method, path, body)
        if status != 404:
            return status, payload
        data = json.loads(body) if body else {}
        self.bodies.setdefault(path, []).append(data)
        if (method, path) == ("GET", "/get_world_size"):
            return 200, {"world_size": 1}
        if (method, path) == ("POST", "/pause"):
            self.paused = True
            return 200, {"status": "paused"}
        if (method, path) == ("POST", "/resume"):
            self.paused = False
            return 200, {"status": "resumed"}
        if (method, path) in (("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update")):
            return 200, {"message": "ok"}
        if (method, path) == ("POST", "/update_weights"):
            if self.hang_update.is_set():
                self._release.wait(WAIT_S)
            if self.update_status != 200:
                return self.update_status, {
                    "error": {"message": "update_info does not match the served model"}
                }
            return 200, {"message": "Weights updated"}
        if (method, path) == ("POST", "/finish_weight_update"):
            self.weight_version = str(data.get("weight_version", self.weight_version))
            return 200, {"message": "Weight update finished"}
        return status, payload
