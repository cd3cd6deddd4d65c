"""The harness runner's fault handling (``rollout/harness/runner.py``, ``proxy.py``), and what the GRPO scorer
makes of an unscored harness rollout.

Boundary: a real ``RecordingProxy`` (uvicorn on loopback) and a real ``HarnessRunner`` starting real processes
(``tests/helpers/harness_agents.py``, one mode per fault) that talk HTTP to the proxy; the policy behind it is a
real ``CompletionClient`` on the scripted ``FakeVllmServer`` (``tests/helpers/fake_server.py``), rendering with the
tiny tokenizer and the ChatML training template ``choose_chat_template`` picks. Nothing is mocked.

Rules every fault test checks: the rollout that comes back (turns recorded, ``unscored`` or not, ``reward``), the
``harness/*`` counts of the metric window, that ``run`` returned within a bound (``timeout`` and
``stop_grace_s`` are well under a second here; every call is also wrapped in ``asyncio.wait_for``), and that
every process the harness started (the script logs its own PID and its children's to ``HARNESS_AGENTS_LOG``) is
gone afterwards: no such PID, or a zombie (this machine's PID 1 does not reap orphans).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from asyncgrpo_cli.config.harness import HarnessConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.agent.tool_calls import HermesToolCallParser
from asyncgrpo_cli.rollout.client import CompletionClient, SamplingParams
from asyncgrpo_cli.rollout.harness.openai_api import RunSampling
from asyncgrpo_cli.rollout.harness.proxy import Policy, RecordingProxy
from asyncgrpo_cli.rollout.harness.runner import HarnessRunner, Outcome, parse_reward
from asyncgrpo_cli.rollout.rewards import RewardFunction
from asyncgrpo_cli.rollout.scorers import ScorerContext
from asyncgrpo_cli.rollout.scorers.grpo import GroupScorer
from asyncgrpo_cli.rollout.sequences import rollout_to_sequences
from asyncgrpo_cli.samples import Rollout, RolloutGroup, TurnRecord
from tests.helpers.fake_server import FakeVllmServer
from tests.helpers.harness_policy import gone, training_tokenizer

SCRIPT = str(Path(__file__).parent / "helpers" / "harness_agents.py")
REPLY_1 = "The answer is 4."
REPLY_2 = "Yes, it is 4!"
CHECK = "Check your answer."
ROW = {"prompt": [{"role": "user", "content": "What is two plus two?"}]}
TIMEOUT_S = 3.0
GRACE_S = 0.5
SLACK_S = 4.0
"""What ``run`` may take beyond its own bound (a Python start on a loaded 2-core machine)."""
SAMPLING = RunSampling(
    temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_completion_length=16
)
COUNTS = (
    "harness/timeout_count",
    "harness/exit_failure_count",
    "harness/bad_output_count",
    "harness/late_request_count",
    "harness/unscored_count",
)


def reward_of(text: str) -> float:
    """The reward line of ``harness_agents.py``."""
    return (len(text) % 3) / 2


@pytest.fixture(scope="module")
def tok():
    return training_tokenizer()


@pytest.fixture
def server(tok):
    """Answers REPLY_2 to a prompt that asks to check the answer, else REPLY_1 (both end with eos)."""

    def reply(ids: list[int], max_tokens: int) -> list[int]:
        text = REPLY_2 if CHECK in tok.decode(ids) else REPLY_1
        return tok.encode(text) + [tok.eos_token_id]

    with FakeVllmServer(reply=reply, eos_token_id=tok.eos_token_id) as srv:
        yield srv


def policy(tok, client: CompletionClient) -> Policy:
    def render(messages, tools, kwargs):
        extra = {"tools": tools} if tools else {}
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra, **kwargs)
        return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]

    async def generate(ids: list[int], max_tokens: int) -> TurnRecord:
        return await client.complete(ids, SamplingParams(max_tokens=max_tokens), None)

    return Policy(
        render=render,
        tokenize=lambda text: [int(t) for t in tok(text)["input_ids"]],
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        token_text=lambda t: tok.decode([t]),
        generate=generate,
        parser=HermesToolCallParser(),
        sampling=SAMPLING,
        max_model_len=4096,
        sampling_mask=False,
        served_model="fake",
        vocab_size=len(tok),
    )


@dataclass
class Bench:
    """A started proxy + runner, and the harness script's event log."""

    runner: HarnessRunner
    metrics: MetricWindow
    log: Path
    elapsed: list[float] = field(default_factory=list)

    async def run(self, row: dict[str, Any] = ROW, bound: float = TIMEOUT_S + GRACE_S + SLACK_S) -> Rollout:
        """``runner.run(row)``, asserting it returns within ``bound`` seconds."""
        t0 = time.monotonic()
        rollout = await asyncio.wait_for(self.runner.run(row), bound + 5.0)
        self.elapsed.append(time.monotonic() - t0)
        assert self.elapsed[-1] < bound, f"run took {self.elapsed[-1]:.2f}s (bound {bound}s)"
        return rollout

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        out = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [e for e in out if kind is None or e["event"] == kind]

    def pids(self) -> list[int]:
        """Every process the harnesses logged: their own and the children they started."""
        return [e["pid"] for e in self.events("start")] + [e["child"] for e in self.events("child")]

    def counts(self) -> dict[str, float]:
        return {k: v for k, v in self.metrics.reduce().items() if k.startswith("harness/")}


@contextlib.asynccontextmanager
async def bench(
    tmp_path: Path,
    tok,
    server: FakeVllmServer,
    mode: str,
    timeout: float = TIMEOUT_S,
    stop_grace_s: float = GRACE_S,
    max_concurrent: int = 4,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
    max_consecutive_failures: int = 32,
):
    log = tmp_path / f"{mode}.jsonl"
    metrics = MetricWindow()
    client = CompletionClient(server.base_url, "fake", timeout=30.0, max_retries=0, max_connections=16)
    cfg = HarnessConfig(
        command=command or ["python", SCRIPT, mode],
        timeout=timeout,
        env={"HARNESS_AGENTS_LOG": str(log), **(env or {})},
        stop_grace_s=stop_grace_s,
        max_consecutive_failures=max_consecutive_failures,
    )
    runner = HarnessRunner(cfg, RecordingProxy(policy(tok, client), metrics), metrics, max_concurrent)
    await runner.start()
    try:
        yield Bench(runner, metrics, log)
    finally:
        await runner.close()
        await client.close()


def assert_all_gone(b: Bench, expected: int) -> None:
    pids = b.pids()
    assert len(pids) == expected, b.events()
    alive = [p for p in pids if not gone(p)]
    assert not alive, f"harness processes still alive: {alive}"


def assert_counts(b: Bench, n: int, **nonzero: float) -> None:
    """Each failure count over ``n`` rollouts: the given ones, 0 for the others (every rollout adds to each);
    one ``harness/duration_s`` per rollout, within what its ``run`` call took."""
    counts = b.counts()
    for name in COUNTS:
        assert counts[name] == nonzero.get(name.split("/")[1], 0.0), (name, counts)
    durations = b.metrics.to_payload()["items"]["harness/duration_s"]
    assert len(durations) == n and all(0 < d <= e for d, e in zip(durations, b.elapsed))


def ids(tok, text: str) -> list[int]:
    return tok.encode(text) + [tok.eos_token_id]


# -- a harness that behaves -----------------------------------------------------------------------------------
def test_a_two_turn_harness_is_recorded_as_one_extending_sample_with_its_reward(tmp_path, tok, server):
    async def main():
        async with bench(tmp_path, tok, server, "two-turn") as b:
            rollout = await b.run()
        return b, rollout

    b, r = asyncio.run(main())
    assert r.unscored is None and r.reward == reward_of(REPLY_2)
    assert [t.output_ids for t in r.turns] == [ids(tok, REPLY_1), ids(tok, REPLY_2)]
    assert r.completion_ids == ids(tok, REPLY_1) + ids(tok, REPLY_2)
    # The re-sent reply renders as the sampled text: turn 2's prompt extends turn 1's prompt + reply.
    first = r.turns[0].prompt_ids + r.turns[0].output_ids
    assert r.turns[1].prompt_ids[: len(first)] == first
    seqs, stats = rollout_to_sequences(r, num_topk=0)
    assert len(seqs) == 1 and int(seqs[0].train_mask.sum()) == len(r.completion_ids)
    assert r.prompt == ROW["prompt"]
    assert r.completion == [
        {"role": "assistant", "content": REPLY_1},
        {"role": "user", "content": CHECK},
        {"role": "assistant", "content": REPLY_2},
    ]
    assert_counts(b, 1)
    assert b.counts()["harness/duration_s"] == pytest.approx(b.elapsed[0], abs=0.5)
    assert "harness/unauthorized_count" not in b.counts()
    assert_all_gone(b, 1)


def test_a_completions_harness_continues_its_own_prompt(tmp_path, tok, server):
    async def main():
        async with bench(tmp_path, tok, server, "completions") as b:
            return b, await b.run({"prompt": "two plus two is"})

    b, r = asyncio.run(main())
    assert r.unscored is None and r.reward == reward_of(REPLY_1)
    assert len(r.turns) == 2 and all(t.output_ids == ids(tok, REPLY_1) for t in r.turns)
    assert tok.decode(r.turns[0].prompt_ids) == "two plus two is"
    assert tok.decode(r.turns[1].prompt_ids) == "two plus two is" + REPLY_1
    assert r.prompt is None and r.completion == [{"role": "assistant", "content": REPLY_1}]
    assert_counts(b, 1)
    assert_all_gone(b, 1)


def test_the_row_arrives_on_stdin_as_json_and_the_environment_names_the_proxy(tmp_path, tok, server):
    row = {
        "prompt": "two plus two is",
        "solution": np.int64(4),
        "weights": np.array([0.5, 1.5], dtype=np.float32),
        "flag": np.bool_(True),
        "text": "ünïcode",
    }

    async def main():
        async with bench(tmp_path, tok, server, "completions", env={"EXTRA_SETTING": "x"}) as b:
            await b.run(row)
            token = b.events("start")[0]["env"]["OPENAI_API_KEY"]
            base = b.runner.proxy.base_url
            async with httpx.AsyncClient() as http:  # the token expired with its rollout
                stale = await http.post(
                    base + "/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {token}"},
                )
            return b, base, stale

    b, base, stale = asyncio.run(main())
    (start,) = b.events("start")
    assert start["row"] == {
        "prompt": "two plus two is",
        "solution": 4,
        "weights": [0.5, 1.5],
        "flag": True,
        "text": "ünïcode",
    }
    env = start["env"]
    assert env["OPENAI_BASE_URL"] == base and base.startswith("http://127.0.0.1:") and base.endswith("/v1")
    assert env["OPENAI_API_KEY"].startswith("agrpo-") and env["ASYNCGRPO_MODEL"] == "fake"
    assert start["pgid"] == start["pid"]  # a session (process group) of its own
    assert stale.status_code == 401 and stale.json()["error"]["code"] == "expired_api_key"
    assert b.counts()["harness/unauthorized_count"] == 1


def test_at_most_max_concurrent_harnesses_run_at_once(tmp_path, tok, server):
    async def main():
        async with bench(
            tmp_path, tok, server, "two-turn", max_concurrent=2, env={"HARNESS_AGENTS_HOLD_S": "0.4"}
        ) as b:
            t0 = time.monotonic()
            rollouts = await asyncio.wait_for(asyncio.gather(*(b.runner.run(ROW) for _ in range(6))), 60)
            return b, rollouts, time.monotonic() - t0

    b, rollouts, wall = asyncio.run(main())
    assert all(r.unscored is None and len(r.turns) == 2 for r in rollouts)
    starts = {e["pid"]: e["t"] for e in b.events("start")}
    ends = {e["pid"]: e["t"] for e in b.events("end")}
    assert len(starts) == len(ends) == 6
    edges = sorted([(t, 1) for t in starts.values()] + [(t, -1) for t in ends.values()])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    assert peak == 2, edges
    assert len({e["env"]["OPENAI_API_KEY"] for e in b.events("start")}) == 6  # a token per rollout
    assert wall >= 3 * 0.4
    assert_counts(b, 6)
    assert_all_gone(b, 6)


# -- faults -----------------------------------------------------------------------------------------------------
def test_a_hanging_harness_times_out_unscored_with_its_turn_kept(tmp_path, tok, server):
    async def main():
        async with bench(tmp_path, tok, server, "hang", timeout=1.0) as b:
            return b, await b.run(bound=1.0 + GRACE_S + SLACK_S)

    b, r = asyncio.run(main())
    assert r.unscored == "timeout" and r.reward is None
    assert [t.output_ids for t in r.turns] == [ids(tok, REPLY_1)]
    assert b.elapsed[0] >= 1.0
    assert_counts(b, 1, timeout_count=1, unscored_count=1)
    assert_all_gone(b, 1)


def test_a_harness_ignoring_sigterm_is_killed_after_the_grace(tmp_path, tok, server):
    async def main():
        async with bench(tmp_path, tok, server, "stubborn", timeout=1.0, stop_grace_s=0.5) as b:
            return b, await b.run(bound=1.0 + 0.5 + SLACK_S)

    b, r = asyncio.run(main())
    assert r.unscored == "timeout" and len(r.turns) == 1
    assert b.elapsed[0] >= 1.0 + 0.5  # SIGTERM did nothing: SIGKILL after stop_grace_s
    assert_counts(b, 1, timeout_count=1, unscored_count=1)
    assert_all_gone(b, 1)


@pytest.mark.parametrize(
    "mode, reason",
    [("crash", "exited with status 1"), ("exit3", "exited with status 3"), ("killed", "died of signal 9")],
)
def test_a_harness_that_fails_is_an_exit_failure(tmp_path, tok, server, mode, reason, caplog):
    async def main():
        async with bench(tmp_path, tok, server, mode) as b:
            return b, await b.run()

    with caplog.at_level("WARNING", logger="asyncgrpo_cli.rollout.harness.runner"):
        b, r = asyncio.run(main())
    assert r.unscored == reason and r.reward is None
    assert [t.output_ids for t in r.turns] == [ids(tok, REPLY_1)]
    assert_counts(b, 1, exit_failure_count=1, unscored_count=1)
    assert_all_gone(b, 1)
    text = caplog.text
    assert reason in text and "unscored" in text
    if mode == "crash":  # the tail of its standard error is logged
        assert "the agent crashed on purpose" in text
    if mode == "exit3":
        assert "giving up" in text


def test_garbage_on_stdout_is_log_output_and_the_rollout_stays_scored(tmp_path, tok, server):
    async def main():
        async with bench(tmp_path, tok, server, "garbage") as b:
            return b, await b.run()

    b, r = asyncio.run(main())
    assert r.unscored is None and r.reward is None  # the reward line was not the last line
    assert len(r.turns) == 1
    assert_counts(b, 1)
    assert_all_gone(b, 1)


def test_a_reward_line_that_is_not_a_number_is_bad_output(tmp_path, tok, server):
    async def main():
        async with bench(tmp_path, tok, server, "bad-reward") as b:
            return b, await b.run()

    b, r = asyncio.run(main())
    assert r.unscored is not None and "bad reward line" in r.unscored and r.reward is None
    assert len(r.turns) == 1
    assert_counts(b, 1, bad_output_count=1, unscored_count=1)
    assert_all_gone(b, 1)


def test_a_request_in_flight_when_the_harness_exits_is_late_and_cancelled(tmp_path, tok, server):
    server.completion_delay_s = 2.0  # the policy is still sampling when the harness leaves

    async def main():
        async with bench(tmp_path, tok, server, "late") as b:
            return b, await b.run(bound=2.0)

    b, r = asyncio.run(main())
    assert r.unscored == "1 request(s) in flight at its exit or sent after it"
    assert r.reward == 1.0  # its reward line is kept, the scorer ignores it (unscored)
    assert r.turns == []  # the cancelled request recorded nothing
    assert_counts(b, 1, late_request_count=1, unscored_count=1)
    assert_all_gone(b, 1)


def test_a_child_left_behind_using_the_token_gets_401_and_is_killed(tmp_path, tok, server):
    async def main():
        # the child lives until the runner's SIGKILL: a 3 s grace leaves it time to send even on a loaded machine
        async with bench(tmp_path, tok, server, "stale", stop_grace_s=3.0) as b:
            return b, await b.run(bound=3.0 + SLACK_S)

    b, r = asyncio.run(main())
    statuses = [e["code"] for e in b.events("status")]
    assert statuses and set(statuses) == {401}, b.events()
    # the child may be killed between the proxy's answer and its logging of it: one answer more at most
    refused = b.counts()["harness/unauthorized_count"]
    assert len(statuses) <= refused <= len(statuses) + 1
    assert [t.output_ids for t in r.turns] == [ids(tok, REPLY_1)]  # nothing after the exit was served
    # a request the child sent just before the SIGKILL may reach the proxy after the runner counted: one fewer
    counted = [n for n in (int(refused), int(refused) - 1) if n >= 1]
    assert r.unscored in {f"{n} request(s) in flight at its exit or sent after it" for n in counted}
    assert r.reward == 1.0  # its reward line is kept, the scorer ignores it
    assert_counts(b, 1, late_request_count=refused, unscored_count=1)
    assert_all_gone(b, 2)


def test_a_grandchild_left_in_the_group_is_killed_and_the_rollout_scored(tmp_path, tok, server):
    async def main():
        async with bench(tmp_path, tok, server, "spawn-sleeper") as b:
            return b, await b.run()

    b, r = asyncio.run(main())
    assert r.unscored is None and r.reward == 0.5 and r.turns == []
    assert_counts(b, 1)
    assert_all_gone(b, 2)


def test_a_harness_that_never_reads_stdin_runs_even_on_a_large_row(tmp_path, tok, server):
    row = {"prompt": "x" * (1 << 20)}  # far beyond a pipe's buffer

    async def main():
        async with bench(tmp_path, tok, server, "no-stdin") as b:
            return b, await b.run(row)

    b, r = asyncio.run(main())
    assert r.unscored is None and r.reward == 1.0 and len(r.turns) == 1
    assert b.events("start")[0]["row"] is None
    assert_counts(b, 1)
    assert_all_gone(b, 1)


def test_consecutive_failures_stop_the_run_naming_the_last_and_a_success_resets_the_count(
    tmp_path, tok, server
):
    async def main():
        async with bench(tmp_path, tok, server, "exit3", max_consecutive_failures=2) as b:
            first = await b.run()
            b.runner.command[-1] = "two-turn"  # a success between failures starts the count again
            assert (await b.run()).unscored is None
            b.runner.command[-1] = "exit3"
            assert (await b.run()).unscored == "exited with status 3"
            with pytest.raises(
                UserError, match=r"last 2 harness runs all failed \(the last: exited with status 3"
            ):
                await b.run()
            return first

    assert asyncio.run(main()).unscored == "exited with status 3"  # one failure alone is only unscored


def test_close_kills_the_live_harness_groups(tmp_path, tok, server):
    async def main():
        async with bench(tmp_path, tok, server, "stubborn", timeout=60.0, stop_grace_s=30.0) as b:
            task = asyncio.create_task(b.runner.run(ROW))
            deadline = time.monotonic() + 30
            while not b.events("start") and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # its first request is served
            t0 = time.monotonic()
            await b.runner.close()
            assert not b.runner.groups.live
            r = await asyncio.wait_for(task, 10)
            return b, r, time.monotonic() - t0

    b, r, after_close = asyncio.run(main())
    assert after_close < 5.0  # neither the 60 s timeout nor the 30 s grace
    assert r.unscored == "the run stopped"  # killed by the run: not a harness failure
    assert b.counts().get("harness/exit_failure_count", 0) == 0
    assert_all_gone(b, 1)


def test_a_command_that_does_not_exist_is_a_user_error(tmp_path, tok, server):
    async def main():
        async with bench(tmp_path, tok, server, "none", command=[str(tmp_path / "no-such-agent")]) as b:
            with pytest.raises(
                UserError, match=r"rollout\.harness\.command .*no-such-agent.* could not be started"
            ):
                await b.run()
            assert not b.runner.proxy.traces.active and not b.runner.groups.live

    asyncio.run(main())


# -- the reward line --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stdout, outcome",
    [
        (b"", Outcome()),
        (b"\n  \n", Outcome()),
        (b'working...\n{"reward": 0.5}\n\n', Outcome(reward=0.5)),
        (b'{"reward": 1}', Outcome(reward=1.0)),
        (b'{"reward": -2.5, "why": "wrong"}\n', Outcome(reward=-2.5)),
        (b'{"reward": null}\n', Outcome()),
        (b'{"reward": 1.0}\ndone\n', Outcome()),
        (b'{"score": 1.0}\n', Outcome()),
        (b"[1.0]\n", Outcome()),
        (b"0.7\n", Outcome()),
        (b"\xff\xfe\x00garbage\n", Outcome()),
    ],
)
def test_parse_reward_reads_only_a_last_line_reward_object(stdout, outcome):
    assert parse_reward(stdout) == outcome


@pytest.mark.parametrize(
    "line",
    [
        b'{"reward": "high"}',
        b'{"reward": true}',
        b'{"reward": NaN}',
        b'{"reward": Infinity}',
        b'{"reward": [1]}',
    ],
)
def test_parse_reward_refuses_a_reward_that_is_not_a_finite_number(line):
    out = parse_reward(b"log line\n" + line + b"\n")
    assert out.reward is None and out.unscored == f"bad reward line {line.decode()!r}"


# -- scoring ----------------------------------------------------------------------------------------------------
def test_an_unscored_harness_rollout_gets_nan_and_advantage_zero_whatever_its_sources_say():
    def turn(n: int) -> TurnRecord:
        return TurnRecord(
            prompt_ids=[1, 2, 3], output_ids=[10 + n] * (n + 1), output_log_probs=[-0.5] * (n + 1)
        )

    def by_length(completion_ids, **kwargs):
        return [[1.0, 0.0, 0.5, 2.0][len(c) - 1] for c in completion_ids]

    def group(unscored: list[str | None]) -> RolloutGroup:
        rollouts = [
            Rollout(
                completion=[{"role": "assistant", "content": "x"}],
                completion_ids=turn(i).output_ids,
                turns=[turn(i)],
                reward=0.25,
                unscored=u,
            )
            for i, u in enumerate(unscored)
        ]
        return RolloutGroup(
            prompts=[[{"role": "user", "content": "q"}]] * len(rollouts),
            reward_kwargs={},
            completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=[rollout_to_sequences(r, num_topk=0)[0] for r in rollouts],
            model_version=1,
            group_id=3,
            row_index=0,
            rollout_rewards=[r.reward for r in rollouts],
            rollouts=rollouts,
        )

    metrics = MetricWindow()
    scorer = GroupScorer(ScorerContext([RewardFunction("by_length", by_length, False)], metrics, None, None))
    g = group([None, "timeout", None])
    scored = asyncio.run(scorer.score(g))
    # sources: by_length + Rollout.reward 0.25 -> [1.25, 0.25, 0.75]; the timed-out one is NaN, out of mean/std
    np.testing.assert_allclose(g.rewards, [1.25, np.nan, 0.75])
    assert scored.drop_reason is None and len(scored.samples) == 3
    adv = {s.rollout_id: s.advantage for s in scored.samples}
    rew = {s.rollout_id: s.reward for s in scored.samples}
    ids_ = [r.rollout_id for r in g.rollouts]
    assert [adv[i] for i in ids_] == pytest.approx([1.0, 0.0, -1.0])
    assert math.isnan(rew[ids_[1]]) and rew[ids_[0]] == 1.25
    assert metrics.reduce()["reward"] == pytest.approx(1.0)  # the mean of the scored two
    # Two of three unscored: fewer than two scored, the group is dropped.
    assert (
        asyncio.run(scorer.score(group(["timeout", None, "exited with status 1"]))).drop_reason == "zero_std"
    )
