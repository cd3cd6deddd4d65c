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

import signal
import time
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.parent_watch import watch_parent


@dataclass
class SharedState:
    """What the trainer and the rollout process share (see ``rollout/process.py``)."""

    rollout_buffer: Any
    metrics_queue: Any
    log_queue: Any
    """Log records of WARNING and above, forwarded to the trainer's handlers (``rollout.worker.forward_logging``)."""
    exception_queue: Any
    model_version: Any
    token_allowance: Any
    consumed_tokens: Any
    samples_put: Any
    """Samples the rollout process has put on ``rollout_buffer`` (written by it only): the trainer's
    ``rollout/queue_size`` is this minus the samples it has taken."""
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
            log_queue=ctx.Queue(maxsize=1_000),
            exception_queue=ctx.Queue(maxsize=1),
            model_version=ctx.Value("q", 0, lock=False),
            token_allowance=ctx.Value("q", 0, lock=False),
            consumed_tokens=ctx.Value("q", 0, lock=False),
            samples_put=ctx.Value("q", 0, lock=False),
            heartbeat=ctx.Value("d", time.time(), lock=False),
            failed_event=ctx.Event(),
            stop_event=ctx.Event(),
            ready_event=ctx.Event(),
            server_link=new_link_array(ctx),
        )


def child_entry(parent_pid: int, spec_blob: bytes, shared: SharedState) -> None:
    """The spawned process's target (see the module docstring)."""
    watch_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import pickle

    from asyncgrpo_cli.rollout.worker import run_child

    run_child(lambda: pickle.loads(spec_blob), shared)
