"""SIGTERM and Ctrl-C that no C callback can swallow.

Python runs a signal's handler in the main thread, at the next bytecode. When that bytecode belongs to a Python
callback that C code is calling (numba compiling a packing kernel calls back into llvmlite through ctypes; a
``qsort`` comparator; a ``__del__``), the exception the handler raises cannot unwind through the C frames: CPython
hands it to ``sys.unraisablehook``, prints "Exception ignored ...", and carries on. A run whose one SIGTERM (a
scheduler's preemption or timeout) landed there would train on until the scheduler's SIGKILL, leaving its
children behind; a Ctrl-C would need pressing again.

``interruptible()`` installs the SIGTERM handler and a ``sys.unraisablehook`` that recognises a dropped
``Terminated`` or ``KeyboardInterrupt`` and has the same signal sent again a moment later, from a thread of its
own, so the handler runs in ordinary Python frames once the C code returns; until one lands where it can unwind.
Everything else goes to the previous hook. One dropped in the last moment of the block is raised when the block
ends, never sent after the handler is restored (the default action would kill the process without unwinding).

C++ code can also turn the interrupt into an ordinary error: torch's zip writer calls a Python ``write`` and reports
its ``KeyboardInterrupt`` as "unexpected pos ..." (a Ctrl-C during a checkpoint save once ended a run with status 1
and a corrupt-stream message). The handlers count the interrupts that arrive; ``surfaced()`` raises the interrupt in
place of any error that leaves it after one arrived inside it. No library does this; it is small.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

REDELIVER_AFTER_S = 0.05
"""Delay before a dropped interrupt is sent again: long enough for the C code's callback to return."""


class Terminated(BaseException):
    """SIGTERM (a scheduler's timeout or preemption): unwind so everything the run started is stopped."""


_SIGNALS = ((Terminated, signal.SIGTERM), (KeyboardInterrupt, signal.SIGINT))
_RAISES = {signum: kind for kind, signum in _SIGNALS}


class _Arrivals:
    """The interrupts the handlers raised (a count and the last one's signal) and the block's resender."""

    count = 0
    last: int | None = None
    resender: _Resender | None = None


def _raise_interrupt(signum, frame) -> None:
    _Arrivals.count += 1
    _Arrivals.last = signum
    raise _RAISES[signum]()


class _Resender:
    """Sends a dropped interrupt's signal to this process again, ``REDELIVER_AFTER_S`` after :meth:`request`, from
    a thread started up front: the hook may run inside garbage collection, where starting a thread could deadlock,
    so :meth:`request` only sets a value and an event."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._signum: int | None = None
        self._closed = False
        threading.Thread(target=self._run, name="asyncgrpo-interrupts", daemon=True).start()

    def request(self, signum: int) -> None:
        self._signum = signum
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self._closed:
                return
            time.sleep(REDELIVER_AFTER_S)
            with self._lock:
                if self._closed:
                    return
                self._wake.clear()  # before reading: a request from now on wakes the next round
                signum, self._signum = self._signum, None
                if signum is not None:
                    os.kill(os.getpid(), signum)

    def cancel(self) -> None:
        """Forget a request not sent yet (its interrupt is being raised another way)."""
        with self._lock:
            self._signum = None

    def close(self) -> int | None:
        """Stop; the signal of a request not sent yet, if any."""
        with self._lock:
            self._closed = True
            late, self._signum = self._signum, None
        self._wake.set()
        return late


@contextmanager
def interruptible() -> Iterator[None]:
    """Within: SIGTERM raises ``Terminated`` in the main thread, and neither it nor Ctrl-C's ``KeyboardInterrupt``
    is lost to a C callback (module docstring). Restores the previous handlers and hook on exit."""
    previous_handlers = {signum: signal.signal(signum, _raise_interrupt) for _kind, signum in _SIGNALS}
    previous_hook = sys.unraisablehook
    resender = _Arrivals.resender = _Resender()

    def hook(unraisable) -> None:
        for kind, signum in _SIGNALS:
            if isinstance(unraisable.exc_type, type) and issubclass(unraisable.exc_type, kind):
                resender.request(signum)
                return
        previous_hook(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        try:
            late = resender.close()
        finally:
            _Arrivals.resender = None
            sys.unraisablehook = previous_hook
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
        if late is not None and sys.exc_info()[0] is None:  # dropped just now: raise it here instead
            raise _RAISES[late]()


@contextmanager
def surfaced() -> Iterator[None]:
    """Within: an error raised after an interrupt arrived inside the block leaves as that interrupt (chained to
    the error), since C++ code may have reported the interrupt as the error (module docstring). Outside
    ``interruptible()`` no interrupt is counted, and in other threads than the main one (where handlers run) none
    is theirs: errors pass through."""
    before = _Arrivals.count if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    except Exception as error:
        if before is None or _Arrivals.count == before or _Arrivals.last is None:
            raise
        if _Arrivals.resender is not None:
            _Arrivals.resender.cancel()  # it was dropped too, perhaps: this raise delivers it
        raise _RAISES[_Arrivals.last]() from error
