"""Faults of whole processes, the way they happen: a launcher SIGKILLed while its child starts, Ctrl-C in a
terminal, a second training into a busy run directory, a server child that dies, a finished run resumed, a
corrupt checkpoint, an error inside a run. Processes are found and killed by PID; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def children(pid: int) -> dict[int, str]:
    """PID -> command line of each live child of ``pid``."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out[int(stat.parent.name)] = (
                    (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
        except (OSError, ValueError, IndexError):
            continue
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(cond, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def kill_all(pids) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}


def train_cmd(run: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "asyncgrpo_cli", "train", "+recipe=tiny", "logging.console=plain",
        f"hydra.run.dir={run}", *overrides,
    ]  # fmt: skip


def _as_from_a_terminal() -> None:
    """A terminal's foreground job has SIGINT's default disposition. A suite started in the background of a
    non-interactive shell (``cmd &``) inherits SIGINT *ignored*, which Python keeps (it then installs no
    KeyboardInterrupt handler) and passes on: the run would ignore the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_train(run: Path, *overrides: str) -> subprocess.Popen:
    """A run in a session of its own, as from a terminal: the test signals its whole group."""
    return subprocess.Popen(
        train_cmd(run, *overrides),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        preexec_fn=_as_from_a_terminal,
        start_new_session=True,
    )


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


def communicate_or_dump_stacks(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate(timeout)``; when the run has not ended by then, fail with the Python stacks of all its
    threads (the CLI dumps them on SIGUSR1), so a hang names the wait it is in."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        raise AssertionError(
            f"the run did not end within {timeout:.0f}s; its stacks:\n{err[-12000:]}"
        ) from None


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("asyncgrpo: error:")]


# -- orphans (items 1 and 2) ------------------------------------------------------------------------------------
def orphan_test(args: list[str], is_child, expected: int) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.orphan_parent", *args],
        cwd=ROOT,
        env=env(),
        stderr=subprocess.PIPE,
    )
    found: dict[int, str] = {}
    try:
        found = wait_for(
            lambda: (lambda c: c if len(c) >= expected else None)(
                {p: cmd for p, cmd in children(parent.pid).items() if is_child(cmd)}
            ),
            60,
            "the child to start",
            interval=0.05,
        )
        time.sleep(1.0)  # the child is importing or unpickling now
        assert all(alive(p) for p in found), "the child ended by itself before the kill"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        t0 = time.monotonic()
        wait_for(lambda: not any(alive(p) for p in found), 15, f"{sorted(found.values())} to exit")
        assert time.monotonic() - t0 < 15
    finally:
        kill_all([parent.pid, *found])
        parent.wait(timeout=10)
        parent.stderr.close()


def test_a_launcher_killed_while_the_embedded_server_starts_leaves_no_server(tiny_model_dir, tmp_path):
    orphan_test(
        ["server", str(tiny_model_dir), str(tmp_path / "server.log")],
        lambda cmd: "asyncgrpo_cli.embedded" in cmd,
        expected=1,
    )


def test_a_trainer_killed_while_the_rollout_process_starts_leaves_no_process():
    """The rollout process (its spec takes 60 s to unpickle) and multiprocessing's resource tracker."""
    orphan_test(
        ["rollout"],
        lambda cmd: "multiprocessing" in cmd and ("spawn_main" in cmd or "resource_tracker" in cmd),
        expected=2,
    )


# -- Ctrl-C and a second run into the same directory (items 5 and 7) -----------------------------------------
def test_ctrl_c_stops_within_seconds_and_a_busy_run_dir_is_refused(tmp_path):
    run = tmp_path / "run"
    proc = start_train(run, "trainer.max_steps=10000", "trainer.save_steps=1", "trainer.save_total_limit=2")
    try:
        wait_for(lambda: (run / "metrics.jsonl").is_file() or proc.poll() is not None, 180, "a first step")
        assert proc.poll() is None, proc.communicate(timeout=30)[1][-3000:]

        second = subprocess.run(train_cmd(run), capture_output=True, text=True, timeout=120, env=env())
        assert second.returncode == 2, second.stderr[-3000:]
        assert error_lines(second.stderr) == [
            f"asyncgrpo: error: the run directory {run} is in use by another training (pid {proc.pid}); wait for "
            "it to finish or stop it, or train into another directory (hydra.run.dir=DIR)."
        ]
        assert not (run / "error.log").exists()  # the refused run writes nothing into the busy directory

        wait_for(lambda: len(list((run / "checkpoints").glob("step-*"))) >= 1, 120, "a checkpoint")
        time.sleep(0.7)  # saves come every step: the interrupt may well land in one
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        _, err = communicate_or_dump_stacks(proc, 60)
        took = time.monotonic() - t0
    finally:
        stop_group(proc)
    assert proc.returncode == 130, err[-3000:]
    assert took < 8, f"Ctrl-C took {took:.1f}s"
    assert error_lines(err) == ["asyncgrpo: error: interrupted"] and "Traceback" not in err, err[-3000:]
    assert [line for line in err.splitlines() if line.strip()] == ["asyncgrpo: error: interrupted"], err[
        -3000:
    ]

    from asyncgrpo_cli.train.checkpoint import find_resume_checkpoint, missing_files, read_resume_state

    for path in (run / "checkpoints").glob("step-*"):
        assert missing_files(path) == [], path
    last = find_resume_checkpoint("auto", run)
    assert last is not None and read_resume_state(last).trainer.step >= 1


# -- a server the run started dies (item 3; item 10's status 1) ------------------------------------------------
def test_a_dead_embedded_server_fails_the_run_at_once(tmp_path):
    run = tmp_path / "run"
    proc = start_train(run, "trainer.max_steps=10000", "trainer.save_steps=0", "server.timeout=1800")
    try:
        wait_for(lambda: (run / "metrics.jsonl").is_file() or proc.poll() is not None, 180, "a first step")
        assert proc.poll() is None, proc.communicate(timeout=30)[1][-3000:]
        (server,) = [p for p, cmd in children(proc.pid).items() if "asyncgrpo_cli.embedded" in cmd]
        os.kill(proc.pid, signal.SIGUSR1)  # a stack dump of every thread; the run goes on
        time.sleep(1)
        os.kill(server, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = communicate_or_dump_stacks(proc, 60)
        took = time.monotonic() - t0
    finally:
        stop_group(proc)
    assert proc.returncode == 1, err[-3000:]
    assert took < 20, f"the run noticed the dead server after {took:.1f}s"
    (line,) = error_lines(err)
    assert f"the embedded server (pid {server}) exited with status -9 (killed by SIGKILL)" in line
    assert f"log: {run / 'embedded_server.log'}" in line
    assert "Traceback" not in err, err[-3000:]
    assert "Current thread 0x" in err and "asyncgrpo_cli/train/" in err, err[-3000:]  # the SIGUSR1 dump
    assert "ServerExitedError" in (run / "error.log").read_text()


# -- errors inside a run: one line, status 2, error.log (items 8 and 10) ---------------------------------------
def test_a_user_error_inside_a_run_is_printed_once_with_status_2(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        train_cmd(run, "data.prompt_column=question"), capture_output=True, text=True, timeout=180, env=env()
    )
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = error_lines(out.stderr)
    assert "data.prompt_column 'question' is not a column" in line
    assert "Traceback" not in out.stderr
    assert "data.prompt_column" in (run / "error.log").read_text()


# -- a finished run, other data, a corrupt checkpoint (items 6, 12 and 8) --------------------------------------
def test_a_finished_run_resumes_without_a_save_and_a_corrupt_one_names_the_file(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        train_cmd(run, "trainer.max_steps=2", "trainer.save_steps=0"),
        capture_output=True,
        text=True,
        timeout=240,
        env=env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = run / "checkpoints" / "step-000002"
    before = (ckpt.stat().st_ino, (ckpt / "trainer_state.json").stat().st_mtime_ns)

    t0 = time.monotonic()
    out = subprocess.run(
        train_cmd(run, "trainer.max_steps=2", "trainer.resume=auto", "data.split=test"),
        capture_output=True,
        text=True,
        timeout=240,
        env=env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (ckpt.stat().st_ino, (ckpt / "trainer_state.json").stat().st_mtime_ns) == before  # not saved again
    assert "trainer.max_steps=2 is reached" in out.stdout + out.stderr
    assert (
        "data.split: 'train' -> 'test'" in out.stdout + out.stderr
    )  # the warning of a changed prompt source
    assert time.monotonic() - t0 < 60  # it started no server and loaded no model

    state = ckpt / "trainer_state.json"
    state.write_text(state.read_text()[:20])  # truncated
    out = subprocess.run(
        train_cmd(run, "trainer.max_steps=3", "trainer.resume=auto"),
        capture_output=True,
        text=True,
        timeout=240,
        env=env(),
    )
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = error_lines(out.stderr)
    assert f"the checkpoint {ckpt} cannot be resumed: trainer_state.json is truncated or not JSON" in line
    assert "trainer.resume=PATH" in line and f"delete {ckpt}" in line
    assert "Traceback" not in out.stderr
    assert "trainer_state.json" in (run / "error.log").read_text()
    assert json.loads((run / "checkpoints" / "step-000002" / "rollout_state.json").read_text())
