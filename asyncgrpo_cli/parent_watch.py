"""A child process that dies with its parent: a leaf module (stdlib only), imported first thing by every child
the run starts, before anything heavy is imported or unpickled.

Two mechanisms, because neither covers every case alone: Linux's ``PR_SET_PDEATHSIG`` (the kernel signals the
child when the parent thread that started it exits; armed by the launcher before ``exec`` with
``die_with_parent()``, or by the child itself with ``set_parent_death_signal()``), and a thread that polls the
parent PID (any OS; also catches a parent that died before the signal was armed).

Example (first lines of a child's entry)::

    watch_parent(parent_pid)   # SIGTERM ourselves once parent_pid is gone
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

WATCH_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Linux: deliver ``sig`` to this process when its parent thread exits. False where unavailable."""
    prctl = _prctl()
    return prctl is not None and prctl(_PR_SET_PDEATHSIG, int(sig)) == 0


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` arming ``PR_SET_PDEATHSIG`` (SIGTERM) in the child. libc is resolved here, in the parent:
    the child only makes one system call before ``exec``. None where unavailable."""
    prctl = _prctl()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return preexec


def watch_parent(parent_pid: int, interval: float = WATCH_INTERVAL_S) -> None:
    """SIGTERM ourselves once ``parent_pid`` is no longer our parent (it was killed: SIGKILL, OOM)."""
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:  # it died before the death signal was armed
        os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
