"""Server backends: where the generation server comes from.

- ``embedded``: ``train`` starts the project's embedded server on the model it trains and stops it on exit;
- ``vllm``: an external vLLM server at ``server.base_url`` (started by the user; see the README).

A backend's ``start()`` returns once the server answers ``/health`` and lists its model; ``stop()`` is idempotent.
"""

from __future__ import annotations

from pathlib import Path

from asyncgrpo_cli.config.schema import ServerConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.server.child import ServerChild
from asyncgrpo_cli.server.control import ServerControl, ServerInfo


class ServerBackend:
    base_url: str
    info: ServerInfo
    control: ServerControl
    child: ServerChild | None = None
    """The server process when the backend started one (embedded, vllm_launch); None for an external server."""

    def start(self) -> ServerInfo:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def check_alive(self) -> None:
        """Raise ``ServerExitedError`` (pid, status, log and its tail) once the server process this backend
        started has exited. The trainer calls it while it waits for samples: the run fails at once, it does not
        restart the server. A no-op for an external server (the rollout link's deadline covers those)."""
        if self.child is not None:
            self.child.raise_if_exited()

    def _connect(self, cfg: ServerConfig) -> ServerInfo:
        self.control = ServerControl(self.base_url, cfg.timeout)
        self.control.wait_ready(cfg.startup_timeout)
        self.info = self.control.info()
        return self.info


class ExternalBackend(ServerBackend):
    def __init__(self, cfg: ServerConfig, model_path: str, served_model_name: str | None, run_dir: Path):
        self.cfg = cfg
        self.base_url = cfg.base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise UserError(f"server.base_url ({cfg.base_url!r}) must start with http:// or https://")

    def start(self) -> ServerInfo:
        return self._connect(self.cfg)

    def stop(self) -> None:
        if getattr(self, "control", None) is not None:
            self.control.close()


class EmbeddedBackend(ServerBackend):
    def __init__(self, cfg: ServerConfig, model_path: str, served_model_name: str | None, run_dir: Path):
        from asyncgrpo_cli.server.launch import EmbeddedServerProcess

        self.cfg = cfg
        self.process = EmbeddedServerProcess(
            model_path,
            cfg.embedded,
            served_model_name=served_model_name,
            log_path=Path(run_dir) / "embedded_server.log",
            startup_timeout=cfg.startup_timeout,
        )
        self.child = self.process.child

    def start(self) -> ServerInfo:
        self.process.start()
        self.base_url = self.process.base_url
        return self._connect(self.cfg)

    def stop(self) -> None:
        if getattr(self, "control", None) is not None:
            self.control.close()
        self.process.stop()
