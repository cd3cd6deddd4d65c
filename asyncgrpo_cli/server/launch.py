"""Start and stop the embedded server as a child process (what ``train`` and the tests use).

The launcher writes the validated ``EmbeddedServerConfig`` (plus the model, the served name, the ready file and its
own PID) as one JSON file beside the log and runs ``python -m asyncgrpo_cli.embedded --config FILE`` through
``server/child.py`` (own process group, log file, bounded ready wait, group stop by PID). The child reports
readiness by writing ``{"port", "pid"}`` to the ready file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.server.child import ServerChild, loopback_url

PORT_IN_USE_EXIT = 3
"""The child's exit status for a busy port (``asyncgrpo_cli.embedded.__main__`` uses this constant)."""
STOP_GRACE_S = 10.0


def launch_spec(
    model_dir: str, cfg: EmbeddedServerConfig, served_model_name: str | None, ready_file: Path | None
) -> dict[str, Any]:
    """What the launcher hands the child: one JSON object (``embedded/__main__.py`` reads it)."""
    return {
        "model": model_dir,
        "served_model_name": served_model_name,
        "ready_file": str(ready_file) if ready_file else None,
        "parent_pid": os.getpid(),
        "server": dataclasses.asdict(cfg),
    }


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
        self.child = ServerChild("the embedded server", self.log_path)
        self.port: int | None = None
        self._ready_file = self.log_path.with_name(f".{self.log_path.name}.ready.json")
        self.config_path = self.log_path.with_name(f"{self.log_path.stem}.config.json")

    @property
    def proc(self):
        return self.child.proc

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the embedded server is not started")
        return loopback_url(self.cfg.host, self.port)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "asyncgrpo_cli.embedded", "--config", str(self.config_path)]

    def start(self) -> str:
        """Spawn the server and wait for its ready file; return ``base_url``."""
        if self.child.proc is not None:
            return self.base_url
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._ready_file.unlink(missing_ok=True)
        spec = launch_spec(self.model_dir, self.cfg, self.served_model_name, self._ready_file)
        self.config_path.write_text(json.dumps(spec, indent=2) + "\n")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # OpenMP threads spinning at barriers stall whenever another process (the trainer) takes a core: measured
        # 12x slower at 2 threads on a busy 2-core machine. Passive waiting trades a little wake-up latency for it.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.child.spawn(self.command(), env)
        try:
            info = self.child.wait_until(
                self._read_ready,
                self.startup_timeout,
                "server.startup_timeout",
                on_exit=self._raise_port_in_use,
            )
            self.port = int(info["port"])
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def _read_ready(self) -> dict[str, Any] | None:
        try:
            info = json.loads(self._ready_file.read_text())
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) and info.get("pid") == self.child.pid else None

    def _raise_port_in_use(self, code: int) -> None:
        if code == PORT_IN_USE_EXIT:
            tail = self.child.tail()
            last = tail.splitlines()[-1] if tail else ""
            raise UserError(
                last.removeprefix("error: ")
                or f"server.embedded.port ({self.cfg.port}) is in use; pick another port or 0."
            )

    def stop(self) -> None:
        """Terminate the child by PID (SIGTERM, wait up to 10 s, then SIGKILL). Idempotent."""
        self.port = None
        self._ready_file.unlink(missing_ok=True)
        self.child.stop(STOP_GRACE_S)

    def __enter__(self) -> EmbeddedServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
