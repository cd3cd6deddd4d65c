"""Admission: the gates of the rollout loop on plain data, and a server lost while the loop is idle (against the
stdlib fake server): the loop fails within ``server.timeout``, or resumes when the server comes back in time."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from types import SimpleNamespace

import pytest

from asyncgrpo_cli.config.schema import RolloutConfig, SamplingConfig
from asyncgrpo_cli.errors import RolloutWorkerError
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.admission import Admission, ServerLostError
from asyncgrpo_cli.rollout.concurrency import ConcurrencyController
from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop, RolloutSettings
from asyncgrpo_cli.rollout.resync import ServerLink, new_link_array
from asyncgrpo_cli.rollout.rewards import RewardFunction
from asyncgrpo_cli.sample_batch import QueueReader
from asyncgrpo_cli.samples import PromptResolved, RolloutDone, TrainingSequence
from tests.helpers.fake_server import FakeVllmServer

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


def test_a_lost_link_holds_then_fails_past_server_timeout_naming_url_and_key():
    adm, clock, link, window, _ = admission(timeout=30.0)
    link.mark_lost()
    assert not adm.may_start()
    clock.t += 29.0
    assert not adm.may_start()  # within the deadline: hold
    clock.t += 2.0
    with pytest.raises(ServerLostError, match=r"http://127.0.0.1:9 has not answered for 31s") as e:
        adm.may_start()
    assert "server.timeout=30s" in str(e.value) and "raise server.timeout" in str(e.value)
    assert "rollout/server_wait_s" not in window.reduce()


def test_a_link_back_within_the_deadline_resumes_and_the_wait_is_timed():
    adm, clock, link, window, _ = admission(timeout=30.0)
    link.mark_lost()
    assert not adm.may_start()
    clock.t += 10.0
    link.mark_back(weights_kept=False)  # restarted: waits for the trainer's push
    assert not adm.may_start()
    clock.t += 15.0
    link.finish_resync(link.resync_token())
    assert adm.may_start()
    assert window.reduce()["rollout/server_wait_s"] == pytest.approx(25.0)
    link.mark_lost()  # a second loss starts a fresh deadline
    clock.t += 29.0
    assert not adm.may_start()


def test_a_server_back_without_its_weights_for_too_long_fails_with_its_own_message():
    adm, clock, link, _, _ = admission(timeout=5.0)
    link.mark_lost()
    link.mark_back(weights_kept=False)
    assert not adm.may_start()
    clock.t += 6.0
    with pytest.raises(ServerLostError, match="came back without the trained weights"):
        adm.may_start()


# -- the loop against the fake server, idle when the server goes ---------------------------------------------------
class StubTokenizer:
    eos_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kwargs):
        return [1 + len(m["content"]) for m in messages] + [2, 3]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def index_reward(completions, **kwargs):
    return [float(i) for i in range(len(completions))]


def make_loop(srv: FakeVllmServer, server_timeout: float, total_prompts: int | None):
    settings = RolloutSettings(
        sampling=SamplingConfig(num_generations=2, max_completion_length=4),
        rollout=RolloutConfig(metrics_poll_interval_s=0.5),
        base_url=srv.base_url,
        served_model=srv.model,
        max_model_len=256,
        server_timeout=server_timeout,
        max_retries=2,
        num_topk=0,
        tokenizer_path="unused",
        total_prompts=total_prompts,
    )
    shared = SimpleNamespace(
        rollout_buffer=queue.Queue(),
        metrics_queue=queue.Queue(),
        model_version=value(0),
        token_allowance=value(0),  # nothing consumes: idle once the first group is queued
        consumed_tokens=value(0),
        samples_put=value(0),
        heartbeat=value(0.0),
        stop_event=threading.Event(),
        server_link=new_link_array(),
    )
    dataset = [{"prompt": [{"role": "user", "content": "q" * (i + 1)}]} for i in range(8)]
    funcs = [RewardFunction("index_reward", index_reward, False)]
    return AsyncRolloutLoop(settings, dataset, funcs, StubTokenizer(), shared), shared


def drain(q: queue.Queue) -> list:
    """Every item queued now, a group's ``SampleBatch`` as its samples (as the trainer's reader takes them)."""
    reader, out = QueueReader(q), []
    while True:
        try:
            out.append(reader.get_nowait())
        except queue.Empty:
            return out


async def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_a_server_lost_while_idle_fails_the_loop_within_server_timeout():
    srv = FakeVllmServer().start()
    loop, shared = make_loop(srv, server_timeout=1.5, total_prompts=None)
    link = ServerLink(shared.server_link)

    async def run() -> float:
        task = asyncio.create_task(loop.run())
        try:
            await wait_until(lambda: shared.rollout_buffer.qsize() >= 1, 20, "the first group's samples")
            await asyncio.sleep(0.3)
            assert srv.requests["/v1/completions"] == 2  # idle: held by the allowance, nothing in flight
            srv.stop()
            link.mark_lost()  # what the trainer does when its weight push finds the server gone
            t0 = time.monotonic()
            with pytest.raises(ServerLostError) as e:
                await asyncio.wait_for(task, timeout=20)
            assert srv.base_url in str(e.value) and "server.timeout=1.5s" in str(e.value)
            return time.monotonic() - t0
        finally:
            task.cancel()

    try:
        took = asyncio.run(run())
    finally:
        srv.stop()
    assert 1.5 <= took < 8  # the deadline, not forever


@pytest.mark.slow
def test_a_server_back_within_server_timeout_resumes_the_loop():
    srv = FakeVllmServer().start()
    loop, shared = make_loop(srv, server_timeout=20.0, total_prompts=3)
    link = ServerLink(shared.server_link)

    async def run() -> list:
        task = asyncio.create_task(loop.run())
        try:
            await wait_until(lambda: shared.rollout_buffer.qsize() >= 1, 20, "the first group's samples")
            srv.stop()
            link.mark_lost()
            await asyncio.sleep(1.0)
            srv.start()  # same port, weights back at "default": the loop's watcher asks for a resync
            await wait_until(lambda: link.resync_requested, 10, "the watcher to request a resync")
            assert not task.done()
            assert link.finish_resync(link.resync_token())  # the trainer pushed the weights again
            shared.token_allowance.value = 10**9  # and consumes again
            await asyncio.wait_for(task, timeout=30)
        finally:
            task.cancel()
        return drain(shared.rollout_buffer)

    try:
        items = asyncio.run(run())
    finally:
        srv.stop()
    samples = [x for x in items if isinstance(x, TrainingSequence)]
    assert len(samples) == 6 and not [x for x in items if isinstance(x, PromptResolved)]
    assert isinstance(items[-1], RolloutDone) and items[-1].num_prompts == 3
    window = MetricWindow()
    for payload in drain(shared.metrics_queue):
        window.merge(payload)
    assert window.reduce()["rollout/server_wait_s"] > 1.0


@pytest.mark.slow
def test_the_lost_server_reaches_the_trainer_as_the_rollout_process_error(tiny_model_dir):
    """Through the real spawned process: the failure event and the remote traceback carry the error."""
    from asyncgrpo_cli.rollout.process import RolloutProcess, RolloutSpec

    srv = FakeVllmServer().start()
    loop, _ = make_loop(srv, server_timeout=2.0, total_prompts=None)
    settings = loop.settings
    settings.tokenizer_path = str(tiny_model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"{i} + {i}"}]} for i in range(8)]
    rollout = RolloutProcess(
        RolloutSpec("default", settings, rows, ["digits"]), worker_timeout=120, start_timeout=120
    )
    try:
        rollout.start()
        got_samples = False
        deadline = time.monotonic() + 60
        while not got_samples and time.monotonic() < deadline:
            got_samples = rollout.get(timeout=1.0) is not None
        assert got_samples, "the rollout process produced nothing"
        srv.stop()
        rollout.server_link.mark_lost()
        t0 = time.monotonic()
        with pytest.raises(RolloutWorkerError) as e:
            while time.monotonic() - t0 < 30:
                rollout.get(timeout=1.0)
        took = time.monotonic() - t0
    finally:
        rollout.stop()
        srv.stop()
    msg = str(e.value)
    assert "the rollout process failed: ServerLostError" in msg and srv.base_url in msg
    assert "server.timeout=2s" in msg  # one line for the console; the traceback goes to error.log
    assert "ServerLostError" in e.value.remote_traceback and "Traceback" in e.value.remote_traceback
    assert took < 15


@pytest.mark.slow
def test_rollout_process_warnings_reach_the_trainers_handlers(tiny_model_dir, caplog):
    """A warning logged in the rollout process (here by a reward function) is handed to the trainer's logging,
    so the live console prints it above its progress block and train.log keeps it."""
    from asyncgrpo_cli.rollout.process import RolloutProcess, RolloutSpec

    srv = FakeVllmServer().start()
    loop, _ = make_loop(srv, server_timeout=10.0, total_prompts=None)
    settings = loop.settings
    settings.tokenizer_path = str(tiny_model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"{i} + {i}"}]} for i in range(4)]
    rollout = RolloutProcess(
        RolloutSpec("default", settings, rows, ["tests.helpers.bad_rewards:warning_reward"]),
        worker_timeout=120,
        start_timeout=120,
    )
    caplog.set_level(logging.WARNING, logger="my_pkg.rewards")
    try:
        rollout.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "warning_reward saw" not in caplog.text:
            rollout.get(timeout=1.0)
            rollout.drain_metrics()
    finally:
        rollout.stop()
        srv.stop()
    assert "warning_reward saw 2 completions" in caplog.text
    assert any(r.name == "my_pkg.rewards" and r.levelno == logging.WARNING for r in caplog.records)
