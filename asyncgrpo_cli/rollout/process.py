"""The rollout process: spawned, CPU-only, runs an ``AsyncRolloutLoop`` on its own asyncio event loop.

The trainer talks to it through shared state only: the rollout queue (samples and markers), the model version,
the token allowance, a consumed-tokens counter, a wall-clock heartbeat, a failure event with the remote traceback,
a stop event, a metrics queue, and the server link (``rollout.resync``: server lost, weights to push again).
Every wait on the trainer side has a timeout: a crash in the rollout process stops training with that traceback,
and a hung process (no heartbeat for ``rollout_worker_timeout``) too, and a server the run owns that exited
(``server_check``). The process watches the trainer from its first moment (``rollout/child.py``), so a killed
trainer never leaves it behind.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from asyncgrpo_cli.errors import RolloutWorkerError, UserError
from asyncgrpo_cli.rollout.child import SharedState, child_entry
from asyncgrpo_cli.rollout.resync import ServerLink
from asyncgrpo_cli.rollout.worker import RolloutSpec
from asyncgrpo_cli.sample_batch import QueueReader

# Environment variables that must not leak into the rollout process (it has no GPU and is not a torch rank).
_STRIP_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)
QUEUE_POLL_S = 1.0
STOP_GRACE_S = 5.0
"""How long ``stop`` waits for the process to see the stop event before it terminates it."""


@contextmanager
def _child_environment():
    """Hide GPUs and the distributed env from the child (spawn copies os.environ at start)."""
    saved = {k: os.environ.get(k) for k in (*_STRIP_ENV, "CUDA_VISIBLE_DEVICES")}
    for k in _STRIP_ENV:
        os.environ.pop(k, None)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class RolloutProcess:
    """Trainer-side handle: start, pull samples with health checks, publish version/allowance, stop."""

    def __init__(self, spec: RolloutSpec, worker_timeout: float, start_timeout: float):
        self.spec = spec
        self.worker_timeout = worker_timeout
        self.start_timeout = start_timeout
        self.ctx = mp.get_context("spawn")
        self.shared = SharedState.create(self.ctx)
        self.reader = QueueReader(self.shared.rollout_buffer)
        """The rollout queue one item at a time (a group's samples arrive as one ``SampleBatch``)."""
        self.server_link = ServerLink(self.shared.server_link)
        self.process: Any = None
        self.on_idle: Any = None
        """Called (no arguments) while ``get`` waits on an empty queue: the trainer resyncs weights from here."""
        self.server_check: Callable[[], None] | None = None
        """Called by ``check_health``: raises once a server the run owns has exited (``ServerBackend.check_alive``)."""

    def start(self) -> None:
        try:
            blob = pickle.dumps(self.spec)
        except Exception as e:
            raise UserError(
                f"the rollout process's inputs cannot be pickled ({type(e).__name__}: {e}); reward functions, "
                "rollout loops and datasets run in a spawned process: use module-level functions/classes, "
                "functools.partial or callable instances, not lambdas or closures."
            ) from e
        with _child_environment():
            self.process = self.ctx.Process(
                target=child_entry,
                args=(os.getpid(), blob, self.shared),
                daemon=True,
                name="asyncgrpo-rollout",
            )
            self.process.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.shared.ready_event.wait(0.2):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                self.stop()
                raise RolloutWorkerError(
                    f"the rollout process did not start within rollout.start_timeout={self.start_timeout:.0f}s"
                )

    # -- trainer-facing state ------------------------------------------------------------------------------
    def set_model_version(self, version: int) -> None:
        self.shared.model_version.value = int(version)

    def set_allowance(self, tokens: int) -> None:
        self.shared.token_allowance.value = int(tokens)

    def add_consumed(self, tokens: int) -> None:
        self.shared.consumed_tokens.value += int(tokens)

    def queue_size(self) -> int:
        """Samples the rollout process has queued that the trainer has not taken yet."""
        return max(0, int(self.shared.samples_put.value) - self.reader.taken)

    def get(self, timeout: float, group: bool = False) -> Any:
        """Next item from the rollout queue, or None after ``timeout``; raises if the process failed or hung. With
        ``group=True`` samples come as a list, the rest of their group (``QueueReader``)."""
        deadline = time.monotonic() + timeout
        while True:
            wait = min(QUEUE_POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                return self.reader.get(timeout=wait, group=group)
            except queue.Empty:
                self.check_health()
                if self.on_idle is not None:
                    self.on_idle()
                if time.monotonic() >= deadline:
                    return None

    def poll(self, group: bool = False) -> Any:
        """The next item if one is queued now, else None: never waits and runs no health check or ``on_idle``
        (the step collector drains the queue with it while the trainer's GPU work runs, ``StepCollector.prefetch``)."""
        try:
            return self.reader.get_nowait(group=group)
        except queue.Empty:
            return None

    def put_back(self, samples: list) -> None:
        """Samples from the last ``get``/``poll`` the trainer did not use: they come first again."""
        self.reader.put_back(samples)

    def forward_logs(self) -> None:
        """Hand the rollout process's forwarded log records to this process's handlers (by logger name)."""
        while True:
            try:
                record = self.shared.log_queue.get_nowait()
            except (queue.Empty, OSError, ValueError):
                return
            logging.getLogger(record.name).handle(record)

    def drain_metrics(self) -> list[dict]:
        self.forward_logs()
        out = []
        while True:
            try:
                out.append(self.shared.metrics_queue.get_nowait())
            except queue.Empty:
                return out

    def check_health(self) -> None:
        self.forward_logs()
        self._raise_if_failed()
        if self.server_check is not None:
            self.server_check()
        age = time.time() - self.shared.heartbeat.value
        if age > self.worker_timeout:
            raise RolloutWorkerError(
                f"the rollout process sent no heartbeat for {age:.0f}s (rollout.rollout_worker_timeout="
                f"{self.worker_timeout:.0f}s): it is hung (a blocking reward function or hook on its event loop?)"
            )

    def _raise_if_failed(self) -> None:
        if self.shared.failed_event.is_set():
            try:
                name, msg, tb = self.shared.exception_queue.get(timeout=5)
            except queue.Empty:
                name, msg, tb = "Unknown", "no details", ""
            raise RolloutWorkerError(f"the rollout process failed: {name}: {msg}", remote_traceback=tb)
        if self.process is not None and not self.process.is_alive():
            raise RolloutWorkerError(
                f"the rollout process exited unexpectedly (exit code {self.process.exitcode})"
            )

    def stop(self) -> None:
        """Stop the process (idempotent): stop event, then terminate, then kill; by PID, with timeouts."""
        if self.process is None:
            return
        self.shared.stop_event.set()
        self.process.join(STOP_GRACE_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.process = None
        self.forward_logs()
        for q in (self.shared.rollout_buffer, self.shared.metrics_queue, self.shared.log_queue):
            q.cancel_join_thread()
