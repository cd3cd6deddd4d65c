"""Faults: retries against a fake server that fails on purpose, the server-link protocol that holds generation
until the weights are pushed to a restarted server, and a real run whose embedded server is killed and restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.rollout.client import CompletionClient, SamplingParams, ServerRequestError
from asyncgrpo_cli.rollout.resync import LOST, OK, RESYNC, ServerLink, ServerWatch, settle_when_back
from asyncgrpo_cli.server.launch import EmbeddedServerProcess
from tests.helpers.fake_server import DROP, FakeVllmServer, completion_tokens

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7]
PARAMS = SamplingParams(max_tokens=4, num_logprobs=2)


def client_for(srv: FakeVllmServer, **kw) -> CompletionClient:
    kw.setdefault("max_retries", 5)
    return CompletionClient(srv.base_url, srv.model, timeout=10.0, max_connections=8, **kw)


async def complete(client: CompletionClient):
    try:
        return await client.complete(PROMPT, PARAMS, seed=1)
    finally:
        await client.close()


async def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


# -- the link state machine on plain data ---------------------------------------------------------------------
def test_link_transitions_and_the_loss_token():
    link = ServerLink()
    assert link.state == OK and link.healthy
    assert link.mark_back(weights_kept=False) is None  # not lost: nothing to come back from
    assert link.mark_lost() is True and link.state == LOST
    assert link.mark_lost() is False  # already lost; the loss is still counted
    assert link.losses == 2
    assert link.resync_token() is None  # no resync requested while lost
    assert link.mark_back(weights_kept=False) == RESYNC and link.resync_requested
    token = link.resync_token()
    assert link.finish_resync(token) is True and link.healthy

    link.mark_lost()
    assert link.mark_back(weights_kept=True) == OK  # a blip: the server kept the weights, no push needed


def test_a_loss_during_the_resync_push_is_not_cleared():
    link = ServerLink()
    link.mark_lost()
    link.mark_back(weights_kept=False)
    token = link.resync_token()
    link.mark_lost()  # the server died again while the trainer pushed
    link.mark_back(weights_kept=False)  # ... and came back: the push went to the previous instance
    assert link.finish_resync(token) is False and link.resync_requested
    assert link.finish_resync(link.resync_token()) is True


# -- retries against the fake server --------------------------------------------------------------------------
def test_5xx_answers_are_retried_and_counted():
    with FakeVllmServer() as srv:
        srv.fail("/v1/completions", times=2, status=503)
        client = client_for(srv)
        turn = asyncio.run(complete(client))
        assert turn.output_ids == completion_tokens(PROMPT, 4)
        assert client.retry_count == 2 and srv.requests["/v1/completions"] == 3


def test_5xx_retries_are_bounded_by_max_retries():
    with FakeVllmServer() as srv:
        srv.fail("/v1/completions", times=5, status=500)
        client = client_for(srv, max_retries=1)
        with pytest.raises(ServerRequestError, match="failed 2 times"):
            asyncio.run(complete(client))
        assert client.retry_count == 1 and srv.requests["/v1/completions"] == 2


def test_a_4xx_is_not_retried():
    with FakeVllmServer(model="other") as srv:
        srv.fail("/v1/completions", times=1, status=400)
        client = client_for(srv)
        with pytest.raises(ServerRequestError, match="HTTP 400"):
            asyncio.run(complete(client))
        assert client.retry_count == 0


def test_dropped_connections_are_retried():
    with FakeVllmServer() as srv:
        srv.fail("/v1/completions", times=2, status=DROP)
        client = client_for(srv)
        turn = asyncio.run(complete(client))
        assert turn.output_ids == completion_tokens(PROMPT, 4)
        assert client.retry_count == 2


def test_connection_failures_are_retried_until_the_server_comes_back():
    """Time-based budget: far more attempts than max_retries, while the server is down for a few seconds."""
    srv = FakeVllmServer().start()
    srv.stop()
    try:

        async def run() -> tuple[CompletionClient, object]:
            client = client_for(srv, max_retries=0, retry_budget_s=60.0)
            task = asyncio.create_task(complete(client))
            await wait_until(lambda: client.retry_count >= 2, 10, "two failed attempts")
            srv.start()  # same port
            return client, await asyncio.wait_for(task, timeout=30)

        client, turn = asyncio.run(run())
        assert turn.output_ids == completion_tokens(PROMPT, 4)
        assert client.retry_count >= 2  # max_retries=0 does not bound connection failures
    finally:
        srv.stop()


def test_connection_failures_stop_at_the_time_budget():
    srv = FakeVllmServer().start()
    srv.stop()
    client = client_for(srv, retry_budget_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(ServerRequestError, match="could not be reached for 1.5s"):
        asyncio.run(complete(client))
    assert time.monotonic() - t0 < 6
    assert client.retry_count >= 1


# -- restart detection and resync hold ------------------------------------------------------------------------
def test_a_restarted_server_gets_no_request_until_the_weights_are_pushed_again():
    srv = FakeVllmServer().start()
    srv.weight_version = "v3"  # the trainer pushed v3
    link = ServerLink()
    try:

        async def run() -> None:
            watch = ServerWatch(link, srv.base_url, interval_s=0.05, timeout_s=2.0)
            watcher = asyncio.create_task(watch.run())
            client = client_for(srv, retry_budget_s=60.0, link=link)
            try:
                srv.stop()  # crash
                task = asyncio.create_task(client.complete(PROMPT, PARAMS, seed=1))
                await wait_until(lambda: link.lost, 10, "the client to notice the loss")
                assert client.lost_count == 1
                srv.start()  # back on the same port, with the weights it loaded at start ("default")
                await wait_until(lambda: link.resync_requested, 10, "the watcher to request a resync")
                assert watch.restarts == 1
                await asyncio.sleep(0.5)
                assert not task.done() and srv.requests["/v1/completions"] == 0  # held: nothing sampled yet
                # The trainer's side: push, then clear with the token taken before the push.
                token = link.resync_token()
                srv.weight_version = "v3"
                assert link.finish_resync(token)
                turn = await asyncio.wait_for(task, timeout=20)
                assert turn.output_ids == completion_tokens(PROMPT, 4)
                assert srv.requests["/v1/completions"] == 1
            finally:
                watcher.cancel()
                await watch.close()
                await client.close()

        asyncio.run(run())
    finally:
        srv.stop()


def test_a_dropped_connection_to_a_server_that_kept_its_weights_needs_no_push():
    with FakeVllmServer() as srv:
        srv.weight_version = "v7"
        link = ServerLink()

        async def run() -> int:
            watch = ServerWatch(link, srv.base_url, interval_s=0.05, timeout_s=2.0)
            watcher = asyncio.create_task(watch.run())
            client = client_for(srv, retry_budget_s=30.0, link=link)
            srv.fail("/v1/completions", times=1, status=DROP)
            try:
                await asyncio.wait_for(client.complete(PROMPT, PARAMS, seed=1), timeout=20)
            finally:
                watcher.cancel()
                await watch.close()
                await client.close()
            return watch.restarts

        restarts = asyncio.run(run())
        assert restarts == 0 and link.healthy and link.losses == 1


def test_a_server_without_weight_info_is_resynced():
    """No /weight_info (an older vLLM): the weights cannot be shown to have survived, so they are pushed."""
    with FakeVllmServer() as srv:
        link = ServerLink()
        link.mark_lost()
        srv.fail("/weight_info", times=1, status=404)

        async def run() -> int | None:
            watch = ServerWatch(link, srv.base_url, timeout_s=2.0)
            try:
                return await watch.check_once()
            finally:
                await watch.close()

        assert asyncio.run(run()) == RESYNC


# -- the end of a run: the rollout process has finished, the trainer probes the server itself ------------------
def pushing_resync(srv: FakeVllmServer, link: ServerLink, version: str, pushes: list[int]):
    """The trainer's side (``Trainer.resync_weights_if_needed``): push only when the link asks for it."""

    def resync() -> None:
        token = link.resync_token()
        if token is None:
            return
        srv.weight_version = version
        pushes.append(token)
        assert link.finish_resync(token)

    return resync


def test_a_push_still_owed_when_training_ends_is_made_once_the_server_is_back():
    srv = FakeVllmServer().start()
    srv.stop()  # down at the last scheduled sync: the trainer's push failed and marked the link lost
    link = ServerLink()
    link.mark_lost()
    pushes: list[int] = []
    restart = threading.Timer(1.0, srv.start)
    restart.start()
    try:
        t0 = time.monotonic()
        assert settle_when_back(
            link, srv.base_url, pushing_resync(srv, link, "v9", pushes), lambda: link.healthy, 30, poll_s=0.05
        )
        assert time.monotonic() - t0 >= 1.0  # it waited for the server
        assert pushes == [1] and srv.weight_version == "v9" and link.healthy
    finally:
        restart.join()
        srv.stop()


def test_a_server_down_at_the_end_costs_the_timeout_and_no_push():
    srv = FakeVllmServer().start()
    srv.stop()
    link = ServerLink()
    link.mark_lost()
    pushes: list[int] = []
    t0 = time.monotonic()
    settled = settle_when_back(
        link, srv.base_url, pushing_resync(srv, link, "v9", pushes), lambda: link.healthy, 1.0, poll_s=0.05
    )
    assert not settled and pushes == [] and link.lost
    assert 1.0 <= time.monotonic() - t0 < 10


# -- a real run: kill the server mid-run and start it again on the same port ----------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def total(rows: list[dict], name: str) -> float:
    return sum(r.get(name, 0) or 0 for r in rows)


NUM_PROMPTS = 16
G = 4  # the tiny recipe's num_generations


def test_training_survives_a_server_restart(tiny_model_dir, tmp_path):
    t_start = time.monotonic()
    port = free_port()
    cfg = EmbeddedServerConfig(port=port, max_model_len=256, max_num_seqs=16, num_threads=1)
    first = EmbeddedServerProcess(tiny_model_dir, cfg, log_path=tmp_path / "server1.log", startup_timeout=120)
    second = EmbeddedServerProcess(
        tiny_model_dir, cfg, log_path=tmp_path / "server2.log", startup_timeout=120
    )
    run = tmp_path / "run"
    args = [
        sys.executable, "-m", "asyncgrpo_cli", "train", "+recipe=tiny", "logging.console=plain",
        "server=vllm", f"server.base_url=http://127.0.0.1:{port}", "server.timeout=120",
        "trainer.max_steps=-1", "trainer.num_train_epochs=1", f"data.num_examples={NUM_PROMPTS}",
        "trainer.save_steps=0", "rollout.metrics_poll_interval_s=0.5", f"hydra.run.dir={run}",
    ]  # fmt: skip
    first.start()
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 150
        while len(read_rows(run)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(read_rows(run)) >= 2, f"training never logged two steps:\n{proc.stderr.read()[-3000:]}"
        assert proc.poll() is None, "the run finished before the server could be killed: raise NUM_PROMPTS"
        killed_at_step = read_rows(run)[-1]["step"]

        os.kill(first.proc.pid, signal.SIGKILL)  # a crash, by the PID we started
        first.proc.wait(timeout=10)
        first.stop()
        time.sleep(2.0)  # down for a while: requests fail to connect meanwhile
        second.start()  # same port

        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-4000:]
        weight_info = httpx.get(f"{second.base_url}/weight_info", timeout=10).json()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        first.stop()
        second.stop()
    assert time.monotonic() - t_start < 300  # no hang

    rows = read_rows(run)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[-1]["step"] > killed_at_step  # training went on after the restart
    # The restarted server got the current weights: the last version the trainer published is what it serves,
    # and it reloaded weights (it started from the untrained checkpoint).
    assert weight_info["weight_version"] == f"v{int(rows[-1]['model_version'])}"
    reloads = (tmp_path / "server2.log").read_text().count("reloaded weights from")
    assert reloads >= 1  # by a resync, or by a scheduled push that reached it once it was up
    assert total(rows, "perf/weight_resync_count") <= 2  # one restart, not a storm of pushes

    # Nothing trained twice, nothing lost: every prompt resolved exactly once, and every sample the rollout process
    # produced was trained or dropped once.
    (ckpt,) = (run / "checkpoints").iterdir()
    state = json.loads((ckpt / "rollout_state.json").read_text())
    assert state["trained_prompt_count"] == NUM_PROMPTS and state["prompt_index"] == NUM_PROMPTS
    assert state["resolved_above"] == []
    assert total(rows, "rollout/groups_scored_count") == NUM_PROMPTS
    produced = G * (NUM_PROMPTS - total(rows, "rollout/groups_dropped_count"))
    consumed = (
        total(rows, "batch/samples_per_step")
        + total(rows, "sample/dropped_stale_count")
        + total(rows, "batch/dropped_oversize_count")
    )
    assert consumed == produced
