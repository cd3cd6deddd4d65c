"""Start and stop the embedded server as a child process (what ``train`` and the tests use).

The child runs ``python -m asyncgrpo_cli.server.app`` in its own process group with its output in a log file,
and reports readiness by writing ``{"port", "pid"}`` to a ready file. Every wait has a timeout; the child is
stopped by its PID (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.errors import UserError

PORT_IN_USE_EXIT = (
    3  # asyncgrpo_cli.server.app.PORT_IN_USE_EXIT (not imported: app pulls in the server stack)
)
STOP_GRACE_S = 10.0


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:])


class EmbeddedServerProcess:
    """``with EmbeddedServerProcess(model_dir, cfg, None, log_path, 120) as srv: httpx.get(srv.base_url + ...)``."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: EmbeddedServerConfig,
        served_model_name: str | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 300.0,
    ):
        self.model_dir = str(model_dir)
        self.cfg = cfg
        self.served_model_name = served_model_name
        self.log_path = (
            Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="asyncgrpo-server-")) / "server.log"
        )
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._ready_file = self.log_path.with_name(f".{self.log_path.name}.ready.json")

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the embedded server is not started")
        host = self.cfg.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def command(self) -> list[str]:
        c = self.cfg
        flags: dict[str, object] = {
            "--model": self.model_dir,
            "--host": c.host,
            "--port": c.port,
            "--ready-file": self._ready_file,
            "--max-model-len": c.max_model_len,
            "--max-num-seqs": c.max_num_seqs,
            "--kv-cache-tokens": c.kv_cache_tokens,
            "--dtype": c.dtype,
            "--prefix-cache-size": c.prefix_cache_size,
            "--device": c.device,
            "--num-threads": c.num_threads,
            "--served-model-name": self.served_model_name,
        }
        cmd = [sys.executable, "-m", "asyncgrpo_cli.server.app", "--exit-with-parent"]
        if c.enable_lora:
            cmd.append("--enable-lora")
        for flag, value in flags.items():
            if value is not None:
                cmd += [flag, str(value)]
        return cmd

    def start(self) -> str:
        """Spawn the server and wait for its ready file; return ``base_url``."""
        if self.proc is not None:
            return self.base_url
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._ready_file.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # OpenMP threads spinning at barriers stall whenever another process (the trainer) takes a core: measured
        # 12x slower at 2 threads on a busy 2-core machine. Passive waiting trades a little wake-up latency for it.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        try:
            self.port = self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def _wait_ready(self) -> int:
        deadline = time.monotonic() + self.startup_timeout
        assert self.proc is not None
        while True:
            info = self._read_ready()
            if info is not None:
                return int(info["port"])
            code = self.proc.poll()
            if code is not None:
                self._raise_exited(code)
            if time.monotonic() > deadline:
                raise UserError(
                    f"the embedded server did not become ready within server.startup_timeout="
                    f"{self.startup_timeout:g}s; raise it or look at {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.1)

    def _read_ready(self) -> dict[str, Any] | None:
        try:
            info = json.loads(self._ready_file.read_text())
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) and info.get("pid") == self.proc.pid else None  # type: ignore[union-attr]

    def _raise_exited(self, code: int) -> None:
        tail = _tail(self.log_path)
        if code == PORT_IN_USE_EXIT:
            last = tail.splitlines()[-1] if tail else ""
            raise UserError(
                last.removeprefix("error: ")
                or f"server.embedded.port ({self.cfg.port}) is in use; pick another port or 0."
            )
        raise UserError(
            f"the embedded server exited with status {code} before it was ready "
            f"(log: {self.log_path}):\n{tail}"
        )

    def stop(self) -> None:
        """Terminate the child by PID (SIGTERM, wait up to 10 s, then SIGKILL). Idempotent."""
        proc, self.proc = self.proc, None
        self.port = None
        self._ready_file.unlink(missing_ok=True)
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_GRACE_S)
        except ProcessLookupError:
            pass

    def __enter__(self) -> EmbeddedServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
