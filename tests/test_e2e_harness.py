"""Harness training end to end, the way users run it: ``asyncgrpo train ... rollout.harness.command=[...]`` in a
subprocess, on the tiny random model and the embedded server (the real path: proxy, chat template, sampler
log-probs, reconciliation, scoring, weight sync).

Three runs, each shared by the assertions about it:

- the issue's own command, ``+recipe=tiny`` with the built-in calculator agent: trained tokens and every
  rollout/harness metric the issue names, no failures;
- ``+recipe=harness_tiny`` with ``tests/helpers/harness_agents.py two-turn``: two requests per rollout (the
  second re-sends the first reply: one sample, or two after a fork), its reward line summed with the digits
  reward;
- a flaky harness (a wrapper written here: every sixth start exits 3 before any request, every sixth + 3 runs
  the helper's ``exit3`` mode, one request then exit 3, the rest ``two-turn``): the run still finishes, the failures are
  counted and their rollouts unscored, and no harness process outlives it.

Config mistakes fail before any server starts, naming ``rollout.harness.command``: a harness beside
``rollout.tools``, a program or a python script that does not exist. Rules: nothing is mocked; every process
a test starts is a subprocess it waits for (the run stops its own server and harnesses, which is checked).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
AGENTS = REPO / "tests" / "helpers" / "harness_agents.py"
CALCULATOR = "rollout.harness.command=[python,-m,asyncgrpo_cli.harnesses.calculator_agent]"
TWO_TURN = f"rollout.harness.command=[python,{AGENTS},two-turn]"

FLAKY = '''\
"""Every 6th start exits 3 at once, every 6th + 3 runs `exit3` (one request, then exit 3), the rest `two-turn`."""
import fcntl, json, os, sys

row = sys.stdin.read()
with open(os.environ["FLAKY_COUNTER"], "a+") as f:  # one counter across the concurrent harnesses
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    k = len(f.read())
    f.write(".")
if k % 6 == 0:
    print("no request at all", file=sys.stderr)
    sys.exit(3)
read, write = os.pipe()  # the row again on standard input, for the helper
os.write(write, row.encode())
os.close(write)
os.dup2(read, 0)
mode = "exit3" if k % 6 == 3 else "two-turn"
os.execv(sys.executable, [sys.executable, sys.argv[1], mode])
'''


def launch(run: Path, *overrides: str, timeout: float) -> subprocess.CompletedProcess:
    """``asyncgrpo train`` in a subprocess (``hydra.run.dir=run``), from the repository root."""
    args = [sys.executable, "-m", "asyncgrpo_cli", "train", "logging.console=plain", f"hydra.run.dir={run}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [*args, *overrides], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env
    )


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Run:
    """A finished ``asyncgrpo train``: its process, metrics.jsonl rows and the windows in which rollouts ended."""

    def __init__(self, run: Path, *overrides: str, timeout: float = 180):
        self.proc = launch(run, *overrides, timeout=timeout)
        assert self.proc.returncode == 0, self.proc.stderr[-4000:]
        self.log = self.proc.stdout + self.proc.stderr  # the logging goes to stdout, errors to stderr
        self.rows = metrics(run)
        assert [r["step"] for r in self.rows] == [1, 2, 3], self.rows
        # A step may train only samples already queued: its row then carries no rollout/* metric.
        self.with_rollouts = [r for r in self.rows if "rollout/turns_mean" in r]
        assert self.with_rollouts, self.rows

    def total(self, key: str) -> float:
        return sum(r.get(key) or 0 for r in self.rows)

    def seen(self, key: str) -> list[float]:
        return [r[key] for r in self.rows if key in r]


@pytest.fixture(scope="module")
def calculator_run(tmp_path_factory) -> Run:
    """The issue's command: the built-in agent on ``+recipe=tiny`` (a tools block needs a longer context)."""
    return Run(
        tmp_path_factory.mktemp("calculator") / "run",
        "+recipe=tiny",
        CALCULATOR,
        "server.embedded.max_model_len=2048",
        "packing.token_budget=4096",
        "trainer.max_steps=3",
        "trainer.save_steps=0",
    )


@pytest.fixture(scope="module")
def two_turn_run(tmp_path_factory) -> Run:
    return Run(tmp_path_factory.mktemp("two_turn") / "run", "+recipe=harness_tiny", TWO_TURN)


@pytest.fixture(scope="module")
def flaky_run(tmp_path_factory) -> tuple[Run, list[dict]]:
    """The flaky wrapper's run, and the helper's start events (pid and process group of every helper)."""
    tmp = tmp_path_factory.mktemp("flaky")
    (tmp / "flaky.py").write_text(FLAKY)
    run = Run(
        tmp / "run",
        "+recipe=harness_tiny",
        f"rollout.harness.command=[python,{tmp / 'flaky.py'},{AGENTS}]",
        f"++rollout.harness.env={{FLAKY_COUNTER: {tmp / 'counter'}, HARNESS_AGENTS_LOG: {tmp / 'agents.jsonl'}}}",
    )
    events = [json.loads(line) for line in (tmp / "agents.jsonl").read_text().splitlines()]
    return run, events


def test_the_built_in_agent_trains_on_the_tiny_recipe(calculator_run):
    run = calculator_run
    assert all(r["batch/trained_tokens_per_step"] > 0 for r in run.rows)
    for r in run.with_rollouts:
        assert 1 <= r["rollout/turns_mean"] <= 2  # a reply that calls the calculator gets a second turn
        assert r["rollout/samples_per_rollout"] >= 1
        assert r["harness/exit_failure_count"] == 0 and r["harness/timeout_count"] == 0
        assert r["harness/unscored_count"] == 0 and r["harness/bad_output_count"] == 0
        assert r["harness/duration_s"] > 0
        assert "rewards/digits/mean" in r
    # fork_frac is logged per turn transition: a run whose replies never called the calculator has none.
    forks = run.seen("rollout/fork_frac")
    if forks:
        assert all(0 <= f <= 1 for f in forks)
    else:
        assert all(r["rollout/turns_max"] == 1 for r in run.with_rollouts)
        assert all(r["rollout/samples_per_rollout"] == 1 for r in run.with_rollouts)
    assert "agents: harness python -m asyncgrpo_cli.harnesses.calculator_agent" in run.log
    assert "its rollout is unscored" not in run.log  # the harnesses the run's end stops did not fail


def test_a_two_turn_harness_on_harness_tiny(two_turn_run):
    run = two_turn_run
    assert all(r["batch/trained_tokens_per_step"] > 0 for r in run.rows)
    for r in run.with_rollouts:
        assert r["rollout/turns_mean"] == 2 and r["rollout/turns_max"] == 2
        # the second request re-sends the first reply: it extends the sample, or forks into a second one
        assert 0 <= r["rollout/fork_frac"] <= 1
        assert 1 <= r["rollout/samples_per_rollout"] <= 2
        assert r["harness/exit_failure_count"] == 0 and r["harness/timeout_count"] == 0
        assert r["harness/unscored_count"] == 0
    assert "its rollout is unscored" not in run.log
    # The reward line ((len % 3) / 2, so 0, 0.5 or 1) is summed with the digits reward (in [0, 1]).
    rewards = run.seen("reward")
    digits = run.seen("rewards/digits/mean")
    assert sum(rewards) > sum(digits)


def test_a_flaky_harness_is_counted_and_unscored_and_the_run_finishes(flaky_run):
    run, events = flaky_run
    failures = run.total("harness/exit_failure_count")
    unscored = run.total("harness/unscored_count")
    assert failures > 0 and unscored == failures
    assert run.total("harness/timeout_count") == 0 and run.total("harness/late_request_count") == 0
    assert all(r["batch/trained_tokens_per_step"] > 0 for r in run.rows)
    # Failed rollouts made 0 or 1 request, the others 2.
    turns = run.seen("rollout/turns_mean")
    assert all(0 <= t <= 2 for t in turns) and min(turns) < 2 and max(run.seen("rollout/turns_max")) == 2
    assert "exited with status 3; its rollout is unscored" in run.log
    assert "giving up" in run.log or "no request at all" in run.log
    modes = {e["mode"] for e in events if e["event"] == "start"}
    assert modes == {"two-turn", "exit3"}, modes
    # Every harness process is gone with its rollout (and the run): none left behind.
    time.sleep(0.5)
    alive = []
    for e in events:
        if e["event"] != "start":
            continue
        try:
            cmdline = Path(f"/proc/{e['pid']}/cmdline").read_bytes()
        except OSError:
            continue
        if b"harness_agents.py" in cmdline:
            alive.append(e["pid"])
    assert not alive, alive


def test_a_harness_beside_tools_fails_before_anything_starts(tmp_path):
    run = tmp_path / "run"
    proc = launch(run, "+recipe=harness_tiny", "rollout.tools=[calculator]", timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rollout.harness.command runs its own agent loop" in proc.stderr
    assert "leave rollout.tools and rollout.environment_factory empty" in proc.stderr
    assert "server probe" not in proc.stdout + proc.stderr and not metrics(run)


@pytest.mark.parametrize(
    "command,message",
    [
        (
            "[no-such-agent-program]",
            "rollout.harness.command: 'no-such-agent-program' is not an executable program",
        ),
        (
            "[python,no_such_agent.py]",
            "rollout.harness.command: the script 'no_such_agent.py' does not exist",
        ),
    ],
)
def test_a_missing_harness_program_fails_at_startup(tmp_path, command, message):
    """Before any server starts; not a run whose every rollout fails (unscored: it would never train)."""
    run = tmp_path / "run"
    proc = launch(run, "+recipe=harness_tiny", f"rollout.harness.command={command}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and not metrics(run)
    assert "server probe" not in proc.stdout + proc.stderr
