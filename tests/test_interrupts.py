"""A SIGTERM or Ctrl-C whose exception CPython drops inside a C callback (numba's LLVM compile calling back through
ctypes, where a CI run's SIGTERM once landed and the run trained on) is delivered again and unwinds the run."""

from __future__ import annotations

import ctypes
import gc
import signal
import sys
import threading
import time

import pytest
import torch

from asyncgrpo_cli.interrupts import Terminated, interruptible, surfaced
from tests.helpers.interrupting import SignalOnWrite

_COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


def _signal_inside_a_c_callback(signum: int) -> list[str]:
    """libc's qsort calls a Python comparator; the first call raises ``signum``, so the handler runs (and its
    exception is dropped) inside the callback. Returns what happened, in order."""
    events: list[str] = []

    def compare(a, b) -> int:
        if not events:
            events.append("signalled")
            signal.raise_signal(signum)
        return 0

    values = (ctypes.c_int * 8)(*range(8))
    ctypes.CDLL(None).qsort(values, len(values), ctypes.sizeof(ctypes.c_int), _COMPARE(compare))
    events.append("qsort returned")
    return events


def _wait_for(kind: type[BaseException], events: list[str]) -> None:
    with pytest.raises(kind):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.01)
        events.append("never raised")


@pytest.mark.parametrize("signum, kind", [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_an_interrupt_dropped_in_a_c_callback_is_delivered_again(signum, kind):
    with interruptible():
        events = _signal_inside_a_c_callback(signum)
        assert events == ["signalled", "qsort returned"]  # the first delivery was dropped, as CPython does
        _wait_for(kind, events)
    assert events == ["signalled", "qsort returned"]


@pytest.mark.parametrize("signum, kind", [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_an_interrupt_dropped_as_the_block_ends_is_raised_there_not_sent_later(signum, kind):
    """Sent again after the handler is restored, SIGTERM's default action would kill the process unwound."""
    with pytest.raises(kind):
        with interruptible():
            _signal_inside_a_c_callback(signum)
    time.sleep(0.2)  # nothing is sent after the block: this process lives on


def test_other_dropped_exceptions_reach_the_previous_hook(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_type))

    class Noisy:
        def __del__(self):
            raise ValueError("in __del__")

    with interruptible():
        Noisy()
        gc.collect()
    assert seen == [ValueError]


def test_the_handler_and_hook_are_restored():
    hook, handler = sys.unraisablehook, signal.getsignal(signal.SIGTERM)
    ctrl_c = signal.getsignal(signal.SIGINT)
    with interruptible():
        assert sys.unraisablehook is not hook
        assert signal.getsignal(signal.SIGTERM) is not handler
        with pytest.raises(Terminated):
            signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert sys.unraisablehook is hook
    assert signal.getsignal(signal.SIGTERM) is handler
    assert signal.getsignal(signal.SIGINT) is ctrl_c


@pytest.mark.parametrize("signum, kind", [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_an_interrupt_torch_reports_as_a_corrupt_stream_leaves_as_itself(signum, kind):
    """The CI run whose Ctrl-C landed in a checkpoint save's writer and ended as "unexpected pos ..." (status 1)."""
    with interruptible():
        with pytest.raises(RuntimeError, match="unexpected pos"):  # what torch makes of it
            torch.save({"w": torch.ones(64)}, SignalOnWrite(signum))
        with pytest.raises(kind) as raised:
            with surfaced():
                torch.save({"w": torch.ones(64)}, SignalOnWrite(signum))
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_errors_without_an_interrupt_in_the_block_pass_through():
    with interruptible():
        with pytest.raises(KeyboardInterrupt):  # one before the block is not the block's
            signal.raise_signal(signal.SIGINT)
        with pytest.raises(ValueError), surfaced():
            raise ValueError("a real failure")
    with pytest.raises(RuntimeError, match="unexpected pos"), surfaced():  # outside: no interrupt is counted
        torch.save({"w": torch.ones(64)}, SignalOnWrite(signal.SIGINT))


def test_an_error_in_another_thread_stays_an_error():
    """Signal handlers run in the main thread: a worker thread's error is its own, whatever arrived meanwhile."""
    failed, started, interrupted = [], threading.Event(), threading.Event()

    def worker() -> None:
        try:
            with surfaced():
                started.set()
                interrupted.wait(5)
                raise ValueError("the worker's own failure")
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            failed.append(type(e))

    with interruptible():
        thread = threading.Thread(target=worker)
        thread.start()
        started.wait(5)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        interrupted.set()
        thread.join(5)
    assert failed == [ValueError]
