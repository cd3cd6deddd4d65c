"""SIGTERM and Ctrl-C that no C callback can swallow.

Python runs a signal's handler in the main thread, at the next bytecode. When that bytecode belongs to a Python
callback that C code is calling (numba compiling a packing kernel calls back into llvmlite through ctypes; a
``qsort`` comparator; a ``__del__``), the exception the handler raises cannot unwind through the C frames: CPython
hands it to ``sys.unraisablehook``, prints "Exception ignored ...", and carries on. A run whose one SIGTERM (a
scheduler's preemption or timeout) landed there would train on until the scheduler's SIGKILL, leaving its
children behind; a Ctrl-C would need pressing again.

``interruptible()`` installs the SIGTERM handler and a ``sys.unraisablehook`` that recognises a dropped
``Terminated`` or ``KeyboardInterrupt`` and sends the same signal again a moment later (from a timer thread, so the
handler runs in ordinary Python frames once the C code returns), until one lands where it can unwind. Everything
else goes to the previous hook. No library does this; it is small.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

REDELIVER_AFTER_S = 0.05
"""Delay before a dropped interrupt is sent again: long enough for the C code's callback to return."""


class Terminated(BaseException):
    """SIGTERM (a scheduler's timeout or preemption): unwind so everything the run started is stopped."""


def _terminate(signum, frame) -> None:
    raise Terminated()


_SIGNALS = ((Terminated, signal.SIGTERM), (KeyboardInterrupt, signal.SIGINT))


def _redeliver(signum: int) -> None:
    timer = threading.Timer(REDELIVER_AFTER_S, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


@contextmanager
def interruptible() -> Iterator[None]:
    """Within: SIGTERM raises ``Terminated`` in the main thread, and neither it nor Ctrl-C's ``KeyboardInterrupt``
    is lost to a C callback (module docstring). Restores the previous handler and hook on exit."""
    previous_handler = signal.signal(signal.SIGTERM, _terminate)
    previous_hook = sys.unraisablehook

    def hook(unraisable) -> None:
        for kind, signum in _SIGNALS:
            if isinstance(unraisable.exc_type, type) and issubclass(unraisable.exc_type, kind):
                _redeliver(signum)
                return
        previous_hook(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGTERM, previous_handler)
