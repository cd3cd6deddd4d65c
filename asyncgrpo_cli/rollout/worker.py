"""The rollout process's own side: build the loop from the unpickled spec, run it until the trainer stops it,
and report a failure to the trainer.

``rollout/child.py`` (the spawn target, stdlib only) calls ``run_child`` once the parent watch runs;
``rollout/process.py`` is the trainer's handle on the process. ``shared`` is that module's ``SharedState`` (the
queues, events and values both sides use); this module imports neither, so the three form no circle.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class RolloutSpec:
    """What the child needs to build its loop; pickled once at start (fail fast on unpicklable user code)."""

    loop_target: str
    settings: Any
    dataset: Any
    reward_entries: list[Any]


def run_child(load_spec: Callable[[], RolloutSpec], shared: Any) -> None:
    """The rollout process, once ``rollout.child.child_entry`` started the parent watch. A failure is reported
    to the trainer (which prints it once and keeps the traceback in ``error.log``), then the process exits with
    status 1 without printing it again."""
    import asyncio

    forward_logging(shared.log_queue)
    try:
        spec = load_spec()
        from asyncgrpo_cli import registry
        from asyncgrpo_cli.rollout.rewards import load_reward_funcs

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        from transformers import AutoTokenizer

        loop_cls = registry.resolve("rollout_loop", spec.loop_target)
        tokenizer = AutoTokenizer.from_pretrained(spec.settings.tokenizer_path)
        funcs = load_reward_funcs(spec.reward_entries)
        loop = loop_cls(spec.settings, spec.dataset, funcs, tokenizer, shared)
        shared.heartbeat.value = time.time()
        shared.ready_event.set()
        asyncio.run(_run_until_stopped(loop, shared))
    except BaseException as e:  # report everything, then exit without a second traceback on the console
        info = (type(e).__name__, str(e), traceback.format_exc())
        try:
            shared.exception_queue.put_nowait(
                info
            )  # info before the event: a reader seeing the event sees it
        except Exception:
            sys.stderr.write(info[2])  # the trainer cannot get it: the console is the only place left
        shared.failed_event.set()
        _abandon_queues(shared)  # unread samples must not hold the exit (the trainer stops reading)
        raise SystemExit(1) from None
    # Stopped: nothing is left to hand over (the sample queues are abandoned), so skip the interpreter's teardown
    # of torch and transformers, which holds the trainer's stop (and a Ctrl-C) for seconds on a busy machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _run_until_stopped(loop: Any, shared: Any) -> None:
    import asyncio

    parent = os.getppid()
    main = asyncio.create_task(loop.run())
    while not main.done():
        if os.getppid() != parent:  # the trainer died without stopping us (SIGKILL, OOM): do not linger
            shared.stop_event.set()
        if shared.stop_event.is_set():
            main.cancel()
            break
        await asyncio.sleep(0.1)
    try:
        await main
    except asyncio.CancelledError:
        if not shared.stop_event.is_set():
            raise
        _abandon_queues(shared)
        return
    # Every prompt was generated: stay alive (and beating) until the trainer has drained the queue and stops us.
    while not shared.stop_event.is_set() and os.getppid() == parent:
        shared.heartbeat.value = time.time()
        await asyncio.sleep(0.2)
    _abandon_queues(shared)


def forward_logging(log_queue: Any, level: int = logging.WARNING) -> None:
    """Send this process's log records of ``level`` and above to the trainer, which hands them to its own
    handlers (the live console prints them above its progress block, ``train.log`` keeps them). A full queue drops
    a record rather than blocking the rollout loop."""

    class _Forward(logging.handlers.QueueHandler):
        def enqueue(self, record: logging.LogRecord) -> None:
            try:
                self.queue.put_nowait(record)
            except Exception:  # full (the trainer is not draining) or closing: never block generation
                pass

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = _Forward(log_queue)
    handler.setLevel(level)
    root.addHandler(handler)
    root.setLevel(level)


def _abandon_queues(shared: Any) -> None:
    """On stop, exit without flushing unread items into the pipes (the trainer no longer reads them)."""
    for q in (shared.rollout_buffer, shared.metrics_queue, shared.log_queue):
        q.cancel_join_thread()
