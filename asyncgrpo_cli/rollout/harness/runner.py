"""Running one harness process per rollout (``rollout.harness``), and turning what it did into a ``Rollout``.

For a rollout the runner opens a trace on the proxy (a fresh bearer token), starts ``command`` in a new
session (its own process group) with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``ASYNCGRPO_MODEL`` and
``rollout.harness.env``, writes the dataset row as one JSON line on its standard input and closes it, and waits
up to ``rollout.harness.timeout``. Then, however the process ended, the trace closes (requests in flight are
cancelled, later ones get 401), its whole process group is stopped (SIGTERM, ``stop_grace_s``, SIGKILL) and the
token expires.

Outcomes (a failed one is counted and its rollout *unscored*: reward NaN whatever the sources say, advantage 0,
left out of its group's mean and std, as reference section e treats unscored completions):

- exit status 0: the last non-empty line of standard output may be ``{"reward": <float or null>}`` (a reward
  source, ``Rollout.reward``); any other last line is log output and gives no reward; a last line that is a JSON
  object with a ``reward`` that is not a number is ``harness/bad_output_count``;
- timeout: ``harness/timeout_count``; non-zero exit or a signal: ``harness/exit_failure_count`` (the tail of
  its standard error is logged, for the first few);
- it exited while requests of its own were still being served (they are cancelled), or a process it left
  behind sent one with its token afterwards (401): ``harness/late_request_count``; a late request that comes
  after the rollout's group was scored is only counted;
- the policy server failed under it: the error is raised (the run stops, as for any rollout).

``rollout.harness.max_consecutive_failures`` failed harnesses in a row (default 32) stop the run with the last
failure and its standard error: a broken agent never leaves the trainer waiting on groups that cannot be scored.

Every process a harness leaves behind in its group is stopped with it. Harnesses also die with the rollout
process: the direct child is armed with ``PR_SET_PDEATHSIG`` (Linux), and a SIGTERM to the rollout process stops
every live group first. Standard output and error go to unlinked temporary files, of which only the tails are
read (``OUTPUT_TAIL_BYTES``). A failure of the policy server under a harness stops it at once (the run stops).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.config.harness import HarnessConfig, resolve_command
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.parent_watch import die_with_parent
from asyncgrpo_cli.rollout.harness.proxy import RecordingProxy
from asyncgrpo_cli.rollout.harness.trace import Trace, trace_rollout
from asyncgrpo_cli.samples import Rollout

log = logging.getLogger(__name__)

OUTPUT_TAIL_BYTES = 64 * 1024
STDERR_TAIL_BYTES = 8 * 1024
STDERR_LOGGED = 5
"""Failed harnesses whose standard error tail is logged (then only counted)."""
FAILURE_COUNTS = (
    "harness/exit_failure_count",
    "harness/timeout_count",
    "harness/late_request_count",
    "harness/bad_output_count",
)
EXIT_POLL_S = 0.02
LOOPBACK = "127.0.0.1,localhost"


def _plain(value: Any) -> Any:
    """JSON-ready: numpy values as lists / numbers, NaN and infinities as null (strict JSON parsers refuse
    them), dates as ISO strings, anything else unknown as its string."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def row_json(row: dict[str, Any]) -> str:
    """The dataset row as one line of strict JSON (see ``_plain``)."""
    return json.dumps(_plain(row), ensure_ascii=False, allow_nan=False) + "\n"


@dataclass
class Outcome:
    reward: float | None = None
    unscored: str | None = None
    """Why the rollout cannot be scored (None: it can)."""


def parse_reward(stdout: bytes) -> Outcome:
    """The reward line rule of the module docstring, on a finished harness's standard output."""
    lines = [ln for ln in stdout.decode("utf-8", errors="replace").splitlines() if ln.strip()]
    if not lines:
        return Outcome()
    try:
        value = json.loads(lines[-1])
    except ValueError:
        return Outcome()
    if not isinstance(value, dict) or "reward" not in value:
        return Outcome()
    reward = value["reward"]
    if reward is None:
        return Outcome()
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return Outcome(unscored=f"bad reward line {lines[-1][:200]!r}")
    return Outcome(reward=float(reward))


def _tail(f: Any, limit: int) -> bytes:
    """The last ``limit`` bytes written to the file ``f``."""
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - limit))
    return f.read()


class ProcessGroups:
    """Live harness process groups, stopped on close and on SIGTERM to this process."""

    def __init__(self) -> None:
        self.live: set[int] = set()
        self._previous: Any = None

    def install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            self.kill_all()
            signal.signal(signal.SIGTERM, self._previous if callable(self._previous) else signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)

    def restore_sigterm(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def kill_all(self) -> None:
        for pgid in list(self.live):
            _signal_group(pgid, signal.SIGKILL)
        self.live.clear()


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False once it is gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_running(pgid: int) -> bool:
    """Whether a process of the group still runs. A group holding only zombies counts as done: their parent
    (or an init that does not reap, as in some containers) collects them, but signals still reach a zombie
    group, so ``killpg(pgid, 0)`` alone would hold every leftover harness for the whole grace. Linux reads
    ``/proc``; elsewhere the signal test decides."""
    if not _signal_group(pgid, 0):
        return False
    if not os.path.isdir("/proc/self"):
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


async def stop_group(pgid: int, grace_s: float) -> None:
    """SIGTERM the group, wait up to ``grace_s`` for it to empty, then SIGKILL what is left."""
    if not _signal_group(pgid, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        if not group_running(pgid):
            return
    _signal_group(pgid, signal.SIGKILL)


async def wait_exit(
    proc: asyncio.subprocess.Process, timeout: float, give_up: Callable[[], bool] = lambda: False
) -> bool:
    """Wait up to ``timeout`` seconds for the process itself to exit (False: it still runs, or ``give_up()``
    became true). Not ``Process.wait()``: with pipes, that also waits until they close, which a process it
    left behind holds open."""
    deadline = time.monotonic() + timeout
    while proc.returncode is None:
        if time.monotonic() >= deadline or give_up():
            return False
        await asyncio.sleep(EXIT_POLL_S)
    return True


class HarnessRunner:
    """Runs ``rollout.harness.command`` per rollout against a :class:`RecordingProxy`."""

    def __init__(self, cfg: HarnessConfig, proxy: RecordingProxy, metrics: MetricWindow, max_concurrent: int):
        self.cfg = cfg
        self.command = resolve_command(list(cfg.command))
        self.proxy = proxy
        self.metrics = metrics
        self.groups = ProcessGroups()
        self._slots = asyncio.Semaphore(max(1, max_concurrent))
        self._logged = 0
        self._closing = False
        self._consecutive_failures = 0
        self._last_stderr = ""
        """Set by close(): harnesses still running were stopped with the run, not failed."""

    async def start(self) -> None:
        await self.proxy.start()
        self.groups.install_sigterm()

    async def close(self) -> None:
        self._closing = True  # harnesses killed from here on are the run's doing, not failures
        self.groups.kill_all()
        self.groups.restore_sigterm()
        await self.proxy.close()

    def environment(self, token: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in (self.cfg.env or {}).items()})
        env.update(
            {
                "OPENAI_BASE_URL": self.proxy.base_url,
                "OPENAI_API_KEY": token,
                "OPENAI_API_BASE": self.proxy.base_url,  # what LangChain and litellm read
                "ASYNCGRPO_MODEL": self.proxy.policy.served_model,
            }
        )
        for key in (
            "NO_PROXY",
            "no_proxy",
        ):  # an HTTP(S)_PROXY of the cluster must not carry loopback requests
            env[key] = f"{env[key]},{LOOPBACK}" if env.get(key) else LOOPBACK
        return env

    async def run(self, row: dict[str, Any]) -> Rollout:
        """One rollout: start the harness on ``row``, wait for it, stop its group; the trace as a Rollout."""
        async with self._slots:
            trace = self.proxy.traces.open()
            t0 = time.monotonic()
            try:
                outcome = await self._run_process(row, trace)
            finally:
                self.proxy.traces.close(trace)
            self.metrics.add("harness/duration_s", time.monotonic() - t0)
            self.metrics.add("harness/sampling_s", trace.sampling_s)
        if trace.server_error is not None:
            raise trace.server_error
        late = trace.late_requests
        if late and outcome.unscored is None:
            outcome.unscored = f"{late} request(s) in flight at its exit or sent after it"
        rollout = trace_rollout(trace)
        rollout.reward = outcome.reward
        rollout.unscored = outcome.unscored
        trace.release(rollout)  # a request that still comes with its token unscores it (until it is scored)
        self.metrics.add("harness/unscored_count", float(outcome.unscored is not None))
        self._watch_failures(outcome)
        for name in FAILURE_COUNTS:  # every rollout adds to each count, so a run without failures logs zeros
            self.metrics.add(name, 0.0)
        return rollout

    async def _run_process(self, row: dict[str, Any], trace: Trace) -> Outcome:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            return await self._run_with_output(row, trace, out, err)

    async def _run_with_output(self, row: dict[str, Any], trace: Trace, out: Any, err: Any) -> Outcome:
        """Output goes to unlinked files, not pipes: a process that left the group (``setsid``) can neither
        hold the run on an open pipe nor leak its descriptors; only the tails are read."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=out,
                stderr=err,
                env=self.environment(trace.token),
                cwd=self.cfg.cwd or None,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        except OSError as e:
            raise UserError(
                f"rollout.harness.command {self.command!r} could not be started ({type(e).__name__}: {e}): check "
                "the program's path and permissions (python / python3 run this interpreter)."
            ) from e
        pgid = proc.pid  # start_new_session: the child leads its own group
        self.groups.live.add(pgid)
        timed_out = False
        deadline = time.monotonic() + self.cfg.timeout
        broken = lambda: trace.server_error is not None  # noqa: E731 - the run stops: do not wait on the agent
        try:
            await self._feed(proc, row, self.cfg.timeout)
            timed_out = not await wait_exit(proc, max(0.0, deadline - time.monotonic()), broken)
        finally:
            self.proxy.traces.close(trace)  # its token expires the moment it exits (or times out)
            await stop_group(pgid, self.cfg.stop_grace_s)
            self.groups.live.discard(pgid)
            await wait_exit(proc, self.cfg.stop_grace_s + 1.0)  # SIGKILL was sent
            stdout = _tail(out, OUTPUT_TAIL_BYTES)
            stderr = _tail(err, STDERR_TAIL_BYTES)
        if self._closing or broken():
            return Outcome(unscored="the run stopped")
        if timed_out:
            self.metrics.add("harness/timeout_count", 1)
            self._log_failure(
                f"ran past rollout.harness.timeout={self.cfg.timeout:g}s ({trace.sampling_s:.0f}s of it waiting "
                "for the policy server's answers: a loaded server or weight syncs count too)",
                stderr,
            )
            return Outcome(unscored="timeout")
        if proc.returncode != 0:
            self.metrics.add("harness/exit_failure_count", 1)
            how = (
                f"exited with status {proc.returncode}"
                if proc.returncode > 0
                else f"died of signal {-proc.returncode}"
            )
            self._log_failure(how, stderr)
            return Outcome(unscored=how)
        outcome = parse_reward(stdout)
        if outcome.unscored is not None:
            self.metrics.add("harness/bad_output_count", 1)
            self._log_failure(outcome.unscored, stderr)
        return outcome

    async def _feed(self, proc: asyncio.subprocess.Process, row: dict[str, Any], timeout: float) -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(row_json(row).encode("utf-8"))
            await asyncio.wait_for(proc.stdin.drain(), timeout)
        except (BrokenPipeError, ConnectionResetError, asyncio.TimeoutError):
            pass  # it does not read its input (or already exited): its exit status tells the rest
        finally:
            try:
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):  # pragma: no cover
                pass

    def _watch_failures(self, outcome: Outcome) -> None:
        """Stop the run once ``max_consecutive_failures`` harnesses in a row failed: a broken agent (a bug, a
        missing dependency, an unreachable sandbox) would otherwise leave every group unscored, and the trainer
        waiting for samples that never come."""
        if outcome.unscored is None or self._closing:
            self._consecutive_failures = 0
            return
        self._consecutive_failures += 1
        limit = self.cfg.max_consecutive_failures
        if limit and self._consecutive_failures >= limit:
            raise UserError(
                f"the last {self._consecutive_failures} harness runs all failed (the last: "
                f"{outcome.unscored}{'; ' + self._last_stderr if self._last_stderr else ''}): check "
                f"rollout.harness.command ({' '.join(self.command)}) by running it on one row, or raise "
                "rollout.harness.max_consecutive_failures (0: never stop)."
            )

    def _log_failure(self, how: str, stderr: bytes) -> None:
        tail = stderr.decode("utf-8", errors="replace").strip()[-2000:]
        self._last_stderr = f"its standard error ended with: {tail[-500:]}" if tail else ""
        self._logged += 1
        if self._logged > STDERR_LOGGED:
            return
        log.warning(
            "harness %s %s; its rollout is unscored%s%s",
            " ".join(self.command),
            how,
            f". Standard error ends with:\n{tail}" if tail else " (no standard error)",
            ""
            if self._logged < STDERR_LOGGED
            else "\n(further harness failures are only counted: harness/*)",
        )


def build_harness(
    settings: Any, tokenizer: Any, metrics: MetricWindow, render: Any, generate: Any
) -> HarnessRunner:
    """The runner and proxy of ``settings.rollout.harness`` for a rollout loop: ``render(messages, tools,
    **template_kwargs)`` and ``generate(prompt_ids, max_tokens=...)`` are the loop's own."""
    from asyncgrpo_cli.rollout.agent.tool_calls import tool_call_parser
    from asyncgrpo_cli.rollout.harness.openai_api import RunSampling
    from asyncgrpo_cli.rollout.harness.proxy import Policy

    s = settings.sampling
    policy = Policy(
        render=lambda messages, tools, kwargs: render(messages, tools, **kwargs),
        tokenize=lambda text: [int(t) for t in tokenizer(text)["input_ids"]],
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        token_text=lambda t: tokenizer.decode([t]),
        generate=lambda ids, n: generate(ids, max_tokens=n),
        parser=tool_call_parser(settings.rollout.tool_call_format),
        sampling=RunSampling(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            max_completion_length=s.max_completion_length,
            ignore_mismatch=settings.rollout.harness.sampling_mismatch == "ignore",
        ),
        max_model_len=settings.max_model_len,
        sampling_mask=settings.sampling_mask,
        served_model=settings.served_model,
        vocab_size=len(tokenizer),
    )
    r = settings.rollout
    return HarnessRunner(r.harness, RecordingProxy(policy, metrics), metrics, r.max_concurrent_rollouts)
