"""Admission: the gates of the rollout loop on plain data."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.admission import Admission
from asyncgrpo_cli.rollout.concurrency import ConcurrencyController
from asyncgrpo_cli.rollout.resync import ServerLink

URL = "http://127.0.0.1:9"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def value(v):
    return SimpleNamespace(value=v)


def admission(timeout: float = 30.0, allowance: int = 10**9, cap: int = 8):
    clock, link, window = Clock(), ServerLink(), MetricWindow()
    shared = SimpleNamespace(token_allowance=value(allowance), consumed_tokens=value(0))
    adm = Admission(link, ConcurrencyController(cap), shared, window, 4, URL, timeout, clock=clock)
    return adm, clock, link, window, shared


# -- the gates on plain data ------------------------------------------------------------------------------------
def test_slots_and_allowance_gate_and_backpressure_is_timed():
    adm, clock, _, window, shared = admission(allowance=1000, cap=8)
    assert adm.may_start()
    adm.start(0)
    assert adm.in_flight == 4 and not adm.may_start()  # one group at a time until the first completes
    adm.generated()
    adm.finish(0, [100] * 4, queued_tokens=400)
    assert adm.may_start()  # 400 queued + 400 expected <= 1000
    assert window.reduce()["rollout/backpressure_s"] == 0.0  # the one-at-a-time hold; no time passed
    window.reset()
    adm.start(1)
    adm.start(2)  # the caller decides; 8 rollouts now fill the cap
    assert not adm.may_start()  # slots full: not backpressure
    adm.generated()
    adm.generated()
    adm.finish(1, [100] * 4, 400)
    adm.finish(2, [100] * 4, 400)
    assert not adm.may_start()  # 1200 queued: held by the allowance alone
    clock.t += 2.5
    shared.consumed_tokens.value = 800
    assert adm.may_start()
    assert window.reduce()["rollout/backpressure_s"] == pytest.approx(2.5)
