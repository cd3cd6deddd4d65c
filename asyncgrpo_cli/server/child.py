"""A server the run starts as a child process: one session of its own, its output in a log, a bounded ready wait,
and a stop that signals the whole group by PID (SIGTERM, then SIGKILL).

Both launchers use it: ``server/launch.py`` (the embedded server) and ``server/vllm_launch.py`` (``vllm serve``).
The child also gets ``PR_SET_PDEATHSIG`` on Linux, so a SIGKILLed trainer never leaves a server behind.

Example::

    child = ServerChild("vLLM", run_dir / "vllm_server.log")
    child.spawn(cmd, env)
    child.wait_until(lambda: healthy(url), timeout=600, knob="server.startup_timeout")
    ...
    child.stop(grace=10)
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from asyncgrpo_cli.errors import ServerExitedError, UserError
from asyncgrpo_cli.parent_watch import die_with_parent

log = logging.getLogger(__name__)
T = TypeVar("T")


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file, or ``(no log)``."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def loopback_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` for a server bound on ``host`` (a wildcard bind is reached on loopback)."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerChild:
    """One child server process, owned by PID; ``what`` names it in messages ("the embedded server", "vLLM")."""

    def __init__(self, what: str, log_path: Path):
        self.what = what
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def spawn(self, cmd: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                list(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env),
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        return self.proc

    def tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def exit_code(self) -> int | None:
        """None while the child runs (or was never started), else its exit status."""
        return None if self.proc is None else self.proc.poll()

    def raise_if_exited(self) -> None:
        """Raise ``ServerExitedError`` when the child exited on its own (``stop()`` forgets the child first)."""
        proc = self.proc
        code = None if proc is None else proc.poll()
        if code is None:
            return
        status = f"{code}" if code >= 0 else f"{code} (killed by {_signal_name(-code)})"
        raise ServerExitedError(
            f"{self.what} (pid {proc.pid}) exited with status {status}; log: {self.log_path}\n"
            f"{self.tail()}\nThe run does not restart a server it started: resume it with trainer.resume=auto."
        )

    def wait_until(
        self,
        ready: Callable[[], T | None],
        timeout: float,
        knob: str,
        on_exit: Callable[[int], None] | None = None,
        interval: float = 0.1,
    ) -> T:
        """Poll ``ready()`` until it returns a value; fail with the log tail if the child exits or ``timeout``
        (the value of config key ``knob``) runs out. ``on_exit(code)`` may raise a more specific error first."""
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while True:
            value = ready()
            if value is not None:
                return value
            code = self.proc.poll()
            if code is not None:
                if on_exit is not None:
                    on_exit(code)
                raise UserError(
                    f"{self.what} exited with status {code} before it was ready (log: {self.log_path}):\n"
                    f"{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise UserError(
                    f"{self.what} was not ready within {knob}={timeout:g}s; raise it or look at "
                    f"{self.log_path}:\n{self.tail()}"
                )
            time.sleep(interval)

    def stop(self, grace: float) -> None:
        """SIGTERM the child's process group, wait ``grace`` seconds, then SIGKILL what is left. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the child leads its own group
        _signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not stop within %gs of SIGTERM: killing it", self.what, pgid, grace)
        _wait_group_gone(pgid, timeout=5.0)
        _signal_group(pgid, signal.SIGKILL)
        try:
            proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) survived SIGKILL", self.what, pgid)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    """True once no process of group ``pgid`` is left (vLLM's engine processes exit after its API server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        time.sleep(0.2)
    return False
