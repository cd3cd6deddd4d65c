"""Faults on plain data, in seconds: checkpoints that a kill at any moment cannot leave half-published, an
incomplete checkpoint that ``resume=auto`` skips, corrupt files named with the fix, Ctrl-C inside a DCP save,
the run-directory lock, the startup wait against a closed port, and a dead server child.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncgrpo_cli.config.schema import DataConfig
from asyncgrpo_cli.errors import ServerExitedError, UserError
from asyncgrpo_cli.interrupts import interruptible, surfaced
from asyncgrpo_cli.server.child import ServerChild
from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.train import checkpoint as ckpt
from asyncgrpo_cli.train.checkpoint import (
    TrainerState,
    data_changes,
    data_identity,
    find_resume_checkpoint,
    list_checkpoints,
    load_training_state,
    missing_files,
    read_resume_state,
    save_checkpoint,
)
from asyncgrpo_cli.train.lock import run_dir_lock
from tests.helpers.fake_server import FakeVllmServer
from tests.helpers.interrupting import SignalOnWrite


# -- a tiny "training" to checkpoint ----------------------------------------------------------------------------
class Parts:
    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        self.model(torch.ones(2, 4)).sum().backward()
        self.optimizer.step()

    def save(self, run: Path, step: int, limit: int | None = None, data: dict | None = None) -> Path:
        state = TrainerState(step=step, model_version=step, num_tokens=100 * step)
        return save_checkpoint(
            run,
            self.model,
            None,
            self.optimizer,
            self.scheduler,
            state,
            {"prompt_index": step, "trained_prompt_count": step, "resolved_above": []},
            limit,
            save_hf_model=False,
            data=data,
        )

    def load(self, path: Path) -> None:
        load_training_state(path, self.model, self.optimizer, self.scheduler)


def step_dirs(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))


class Killed(BaseException):
    """Stands for a SIGKILL at one filesystem operation of a save."""


class KillAt:
    """Raise ``Killed`` at the ``k``-th rename or tree removal of a save (a removal deletes one file first)."""

    def __init__(self, k: int):
        self.k, self.calls = k, 0
        self.real_rmtree, self.real_rename = ckpt.shutil.rmtree, Path.rename

    def _tick(self) -> bool:
        self.calls += 1
        return self.calls == self.k

    def rmtree(self, path, ignore_errors=False):
        if self._tick():
            files = [p for p in Path(path).rglob("*") if p.is_file()] if Path(path).exists() else []
            if files:
                files[0].unlink()
            raise Killed()
        return self.real_rmtree(path, ignore_errors=ignore_errors)

    def rename(self, path, target):
        if self._tick():
            raise Killed()
        return self.real_rename(path, target)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
@pytest.mark.parametrize("case", ["resave-same-step", "next-step-with-limit"])
def test_a_kill_at_any_moment_of_a_save_leaves_only_complete_checkpoints(
    tmp_path, monkeypatch, exchange, case
):
    if not exchange:
        monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)
    for k in range(1, 20):
        run = tmp_path / f"k{k}"
        parts = Parts()
        parts.save(run, 1)
        parts.save(run, 2)
        killer = KillAt(k)
        with monkeypatch.context() as m:
            m.setattr(ckpt.shutil, "rmtree", killer.rmtree)
            m.setattr(Path, "rename", lambda path, target, kill=killer: kill.rename(path, target))
            try:
                parts.save(
                    run,
                    2 if case == "resave-same-step" else 3,
                    limit=1 if case != "resave-same-step" else None,
                )
                finished = True
            except Killed:
                finished = False
        for name in step_dirs(run):  # nothing half-published or half-deleted under a step- name
            assert missing_files(run / "checkpoints" / name) == [], (k, name)
        newest = find_resume_checkpoint("auto", run)
        assert newest is not None, (k, step_dirs(run))
        assert read_resume_state(newest).trainer.step in (2, 3), (k, newest)  # never back to step 1
        Parts(seed=1).load(newest)  # loads
        parts.save(run, 4)  # the next save clears the hidden leftovers (or names a parked step 2 again)
        assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
        assert "step-000002" in step_dirs(run) or case != "resave-same-step"
        if finished:  # every operation before this one was a kill point
            return
    raise AssertionError("the save never finished")


def test_an_incomplete_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    parts = Parts()
    parts.save(tmp_path, 1)
    half = parts.save(tmp_path, 2)
    (half / "dcp" / ".metadata").unlink()  # what a half-deleted directory of an older version looks like
    with caplog.at_level(logging.WARNING):
        assert find_resume_checkpoint("auto", tmp_path).name == "step-000001"
    assert "skipping the incomplete checkpoint" in caplog.text and "dcp/.metadata" in caplog.text
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000001"]
    with pytest.raises(UserError, match=r"incomplete \(no dcp/.metadata\)"):
        find_resume_checkpoint(str(half), tmp_path)


def test_ctrl_c_inside_a_dcp_save_is_an_interrupt_and_the_last_checkpoint_stays(tmp_path, monkeypatch):
    parts = Parts()
    parts.save(tmp_path, 1)

    class Interrupting:
        def __reduce__(self):
            raise KeyboardInterrupt()

    real = ckpt._training_state
    monkeypatch.setattr(ckpt, "_training_state", lambda m, o: {**real(m, o), "boom": Interrupting()})
    with pytest.raises(KeyboardInterrupt):  # not torch's CheckpointException (a BaseException)
        parts.save(tmp_path, 2)
    monkeypatch.undo()
    assert step_dirs(tmp_path) == ["step-000001"]
    Parts().load(find_resume_checkpoint("auto", tmp_path))


def test_ctrl_c_that_a_writer_reports_as_an_error_is_an_interrupt_and_the_last_checkpoint_stays(
    tmp_path, monkeypatch
):
    """torch's zip writer calls a Python ``write`` from C++ and reports a Ctrl-C there as "unexpected pos ..."; a
    CI run once ended with that message and status 1 instead of 130. A run's job runs inside ``surfaced()``."""
    parts = Parts()
    parts.save(tmp_path, 1)
    rng_state = ckpt._rng_state

    def rng_state_and_a_ctrl_c_in_torch_writer():
        torch.save({"w": torch.ones(64)}, SignalOnWrite(signal.SIGINT))
        return rng_state()

    monkeypatch.setattr(ckpt, "_rng_state", rng_state_and_a_ctrl_c_in_torch_writer)
    with interruptible(), pytest.raises(KeyboardInterrupt) as raised, surfaced():
        parts.save(tmp_path, 2)
    assert "unexpected pos" in str(raised.value.__cause__)
    assert step_dirs(tmp_path) == ["step-000001"]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


@pytest.mark.parametrize(
    "name", ["trainer_state.json", "rollout_state.json", "dcp/.metadata", "dcp/__0_0.distcp", "scheduler.pt"]
)
def test_a_corrupt_checkpoint_file_is_named_with_the_fix(tmp_path, name):
    path = Parts().save(tmp_path, 1)
    truncate(path / name)
    with pytest.raises(UserError) as err:
        read_resume_state(path)
        Parts().load(path)
    msg = str(err.value)
    assert str(path) in msg and name in msg, msg
    assert "trainer.resume=PATH" in msg and f"delete {path}" in msg
    assert "Traceback" not in msg


def test_resuming_with_other_data_is_noticed(tmp_path):
    old = DataConfig(source="hf", path="/data/a.jsonl")
    path = Parts().save(tmp_path, 1, data=data_identity(old))
    saved = read_resume_state(path).data
    assert data_changes(saved, old) == []
    assert data_changes(saved, DataConfig(source="hf", path="/data/b.jsonl")) == [
        "data.path: '/data/a.jsonl' -> '/data/b.jsonl'"
    ]
    assert data_changes(None, old) == []  # a checkpoint of an older version: nothing to compare


# -- one training per run directory -----------------------------------------------------------------------------
def test_a_second_training_into_a_locked_run_dir_is_refused(tmp_path):
    with run_dir_lock(tmp_path) as lock:
        assert lock.read_text().strip() == str(os.getpid())
        with pytest.raises(
            UserError, match=rf"{tmp_path} is in use by another training \(pid {os.getpid()}\)"
        ):
            with run_dir_lock(tmp_path):
                pass
    with run_dir_lock(tmp_path):  # released on exit
        pass


def test_the_lock_of_a_killed_training_is_free(tmp_path):
    code = (
        "import sys, time; from asyncgrpo_cli.train.lock import run_dir_lock\n"
        f"with run_dir_lock({str(tmp_path)!r}):\n    print('locked', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=f"pid {proc.pid}"):
            with run_dir_lock(tmp_path):
                pass
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        with run_dir_lock(tmp_path) as lock:  # the kernel dropped the dead holder's lock
            assert lock.read_text().strip() == str(os.getpid())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# -- the startup wait ---------------------------------------------------------------------------------------------
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_connection_is_said_at_once_and_counted_down(caplog):
    port = closed_port()
    control = ServerControl(f"http://127.0.0.1:{port}", timeout=10)
    t0, t0_wall = time.monotonic(), time.time()
    with caplog.at_level(logging.INFO), pytest.raises(UserError) as err:
        control.wait_ready(3.0, report_every_s=1.0)
    elapsed = time.monotonic() - t0
    control.close()
    assert 2.9 <= elapsed < 8
    msg = str(err.value)
    assert "server.base_url" in msg and "server.startup_timeout=3s" in msg and "connection refused" in msg
    said = [r for r in caplog.records if "nothing listens on" in r.getMessage()]
    assert (
        len(said) == 1 and f"127.0.0.1:{port}" in said[0].getMessage() and said[0].levelno == logging.WARNING
    )
    assert said[0].created - t0_wall < 2  # after the first refusal, not at the deadline
    countdown = [
        r.getMessage() for r in caplog.records if "s left of server.startup_timeout" in r.getMessage()
    ]
    assert len(countdown) >= 1


def test_the_wait_ends_once_the_server_comes_up():
    srv = FakeVllmServer().start()
    srv.stop()  # the port is known and closed
    threading.Timer(1.0, srv.start).start()
    control = ServerControl(srv.base_url, timeout=10)
    try:
        t0 = time.monotonic()
        control.wait_ready(30.0)
        assert time.monotonic() - t0 < 10  # backoff stays short
    finally:
        control.close()
        srv.stop()


# -- a dead server child ----------------------------------------------------------------------------------------
def test_a_server_child_that_exited_is_reported_with_pid_status_and_log(tmp_path):
    child = ServerChild("the embedded server", tmp_path / "server.log")
    child.spawn(
        [sys.executable, "-c", "print('out of memory, pretend'); raise SystemExit(3)"], dict(os.environ)
    )
    child.proc.wait(timeout=30)
    with pytest.raises(ServerExitedError) as err:
        child.raise_if_exited()
    msg = str(err.value)
    assert f"the embedded server (pid {child.pid}) exited with status 3" in msg
    assert str(tmp_path / "server.log") in msg and "out of memory, pretend" in msg
    child.stop(grace=1)
    child.raise_if_exited()  # stopped by us: nothing to report
