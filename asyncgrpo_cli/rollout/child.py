"""The first moments of the rollout process: a leaf module (stdlib only), so the parent watch starts before
anything heavy is imported or unpickled.

``multiprocessing`` (spawn) unpickles the target and its arguments before the target runs. The arguments here
are light on purpose: the trainer's PID, the ``RolloutSpec`` as bytes (its dataset, settings and user reward
functions may import torch, transformers, datasets, ... when unpickled) and the ``SharedState`` of
multiprocessing primitives. ``child_entry`` then

1. asks Linux to SIGTERM this process when the trainer dies (``PR_SET_PDEATHSIG``) and starts a thread that
   checks the parent PID (which also covers a trainer that died before we got this far, and other systems);
2. ignores SIGINT: a Ctrl-C in the terminal reaches the whole process group, and the trainer, which owns this
   process, stops it through the stop event (a second, uncoordinated shutdown here only raced it);
3. unpickles the spec and runs the loop (``rollout.worker.run_child``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

WATCH_INTERVAL_S = 0.5


@dataclass
class SharedState:
    """What the trainer and the rollout process share (see ``rollout/process.py``)."""

    rollout_buffer: Any
    metrics_queue: Any
    exception_queue: Any
    model_version: Any
    token_allowance: Any
    consumed_tokens: Any
    heartbeat: Any
    failed_event: Any
    stop_event: Any
    ready_event: Any
    server_link: Any

    @classmethod
    def create(cls, ctx: Any) -> SharedState:
        from asyncgrpo_cli.rollout.resync import new_link_array

        return cls(
            rollout_buffer=ctx.Queue(),
            metrics_queue=ctx.Queue(maxsize=10_000),
            exception_queue=ctx.Queue(maxsize=1),
            model_version=ctx.Value("q", 0, lock=False),
            token_allowance=ctx.Value("q", 0, lock=False),
            consumed_tokens=ctx.Value("q", 0, lock=False),
            heartbeat=ctx.Value("d", time.time(), lock=False),
            failed_event=ctx.Event(),
            stop_event=ctx.Event(),
            ready_event=ctx.Event(),
            server_link=new_link_array(ctx),
        )


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Linux: deliver ``sig`` to this process when its parent thread exits. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        pr_set_pdeathsig = 1
        return ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(sig)) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(parent_pid: int, interval: float = WATCH_INTERVAL_S) -> None:
    """Die (SIGTERM ourselves) once ``parent_pid`` is no longer our parent: it was killed (SIGKILL, OOM)."""
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:  # it died before the death signal was armed
        os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def child_entry(parent_pid: int, spec_blob: bytes, shared: SharedState) -> None:
    """The spawned process's target (see the module docstring)."""
    watch_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import pickle

    from asyncgrpo_cli.rollout.worker import run_child

    run_child(lambda: pickle.loads(spec_blob), shared)
