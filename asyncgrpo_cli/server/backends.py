"""Server backends: where the generation server comes from.

- ``embedded``: ``train`` starts the project's embedded server on the model it trains and stops it on exit;
- ``vllm``: an external vLLM server at ``server.base_url`` (started by the user; see the README).

A backend's ``start()`` returns once the server answers ``/health`` and lists its model; ``stop()`` is idempotent.
The contract is ``protocols.ServerBackend``; ``BaseServerBackend`` holds its defaults (those of an external server).
"""

from __future__ import annotations

from pathlib import Path

from asyncgrpo_cli import registry
from asyncgrpo_cli.config.schema import RootConfig, ServerConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.protocols import ServerBackend
from asyncgrpo_cli.server.child import ServerChild
from asyncgrpo_cli.server.control import ServerControl, ServerInfo


class BaseServerBackend(ServerBackend):
    """The defaults of ``protocols.ServerBackend``: a server that runs already, at ``server.base_url``."""

    passes_vllm_flags = False
    base_url: str
    info: ServerInfo
    control: ServerControl | None = None
    child: ServerChild | None = None
    """The server process when the backend started one (embedded, vllm_launch); None for an external server."""

    def start(self) -> ServerInfo:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @classmethod
    def plan(cls, cfg: ServerConfig) -> tuple[str, int | None]:
        return (
            f"{cfg.backend} server at {cfg.base_url} (must be running; timeout {cfg.startup_timeout:g}s)",
            None,
        )

    @classmethod
    def probe_preview(cls, cfg: RootConfig) -> str | None:
        return None

    @classmethod
    def max_model_len_fix(cls, need_len: int, completion: int) -> str:
        return f"or lower sampling.max_completion_length={completion}"

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


class ExternalBackend(BaseServerBackend):
    def __init__(self, cfg: ServerConfig, model_path: str, served_model_name: str | None, run_dir: Path):
        self.cfg = cfg
        self.base_url = cfg.base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise UserError(f"server.base_url ({cfg.base_url!r}) must start with http:// or https://")

    def start(self) -> ServerInfo:
        return self._connect(self.cfg)

    def stop(self) -> None:
        if self.control is not None:
            self.control.close()


class EmbeddedBackend(BaseServerBackend):
    """The embedded server, configured under ``server.embedded``."""

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

    @classmethod
    def plan(cls, cfg: ServerConfig) -> tuple[str, int | None]:
        emb = cfg.embedded
        return (
            f"embedded server started by train on {emb.host}:{emb.port or '<free port>'}",
            emb.max_model_len,
        )

    @classmethod
    def probe_preview(cls, cfg: RootConfig) -> str | None:
        return "--probe-server: the embedded server is started by train; nothing to probe"

    @classmethod
    def max_model_len_fix(cls, need_len: int, completion: int) -> str:
        return (
            f"server.embedded.max_model_len={need_len} (or lower sampling.max_completion_length={completion})"
        )

    def start(self) -> ServerInfo:
        self.process.start()
        self.base_url = self.process.base_url
        return self._connect(self.cfg)

    def stop(self) -> None:
        if self.control is not None:
            self.control.close()
        self.process.stop()


def backend_class(cfg: ServerConfig) -> type[ServerBackend]:
    """The class of ``server.backend`` (a registered name or a ``module:object`` path); builds nothing."""
    return registry.resolve("server", cfg.backend)
