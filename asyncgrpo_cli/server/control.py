"""Synchronous control-plane client for the generation server (trainer side): readiness, model info,
pause/resume, ``collective_rpc``, prefix-cache reset, weight version. Every call has a timeout and a clear error.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from asyncgrpo_cli.errors import UserError

log = logging.getLogger(__name__)
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 2.0
REPORT_EVERY_S = 15.0
"""How often ``wait_ready`` logs the time left while the server is not up."""


def _refused(e: BaseException) -> bool:
    """True when the connect was refused (nothing listens), as opposed to a DNS failure or a timeout."""
    while e is not None:
        if isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
            return True
        if "refused" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


class ServerControlError(RuntimeError):
    """A control call failed (HTTP error or timeout); the message names the route and the server's answer."""


@dataclass
class ServerInfo:
    model_id: str
    max_model_len: int | None


class ServerControl:
    def __init__(self, base_url: str, timeout: float, control_timeout: float = 300.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._client = httpx.Client(
            base_url=self.base_url, timeout=httpx.Timeout(min(timeout, control_timeout), connect=10.0)
        )

    def close(self) -> None:
        self._client.close()

    # -- readiness ---------------------------------------------------------------------------------------------
    def wait_ready(
        self,
        startup_timeout: float,
        key: str = "server.startup_timeout",
        url_key: str = "server.base_url",
        report_every_s: float = REPORT_EVERY_S,
    ) -> None:
        """Poll ``/health`` until it answers 200, with backoff; raise a UserError naming ``url_key`` and ``key``
        after ``startup_timeout``. A refused connection is said at once ("nothing listens on HOST:PORT"), and
        the time left is logged every ``report_every_s`` seconds, so a wrong URL is not a silent wait."""
        t0 = time.monotonic()
        deadline = t0 + startup_timeout
        next_report = t0 + report_every_s
        last, refused_said, pause = "no answer", False, BACKOFF_START_S
        while True:
            try:
                resp = self._client.get("/health", timeout=min(10.0, max(0.5, deadline - time.monotonic())))
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.ConnectError as e:
                last = f"connection refused ({e})" if _refused(e) else f"{type(e).__name__}: {e}"
                if _refused(e) and not refused_said:
                    refused_said = True
                    log.warning(
                        "nothing listens on %s (%s=%s): retrying until %s=%gs runs out",
                        self._host_port(),
                        url_key,
                        self.base_url,
                        key,
                        startup_timeout,
                    )
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            now = time.monotonic()
            if now >= deadline:
                raise UserError(
                    f"the generation server at {self.base_url} did not answer GET /health within {key}="
                    f"{startup_timeout:g}s (last: {last}). Start it (see the README for the vllm serve command), "
                    f"fix {url_key}, or raise {key}."
                )
            if now >= next_report:
                log.info(
                    "waiting for the generation server at %s (last: %s): %.0fs left of %s=%gs",
                    self.base_url,
                    last,
                    deadline - now,
                    key,
                    startup_timeout,
                )
                next_report = now + report_every_s
            time.sleep(min(pause, max(0.05, deadline - now)))
            pause = min(pause * 2, BACKOFF_MAX_S)

    def _host_port(self) -> str:
        url = httpx.URL(self.base_url)
        return f"{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"

    def info(self) -> ServerInfo:
        data = self._json("GET", "/v1/models")
        try:
            first = data["data"][0]
        except (KeyError, IndexError, TypeError):
            raise UserError(
                f"{self.base_url}/v1/models answered {str(data)[:200]!r}, which is not an OpenAI-style "
                "model list: is server.base_url a vLLM server?"
            ) from None
        mml = first.get("max_model_len")
        return ServerInfo(model_id=str(first["id"]), max_model_len=int(mml) if mml is not None else None)

    # -- weight-update control -----------------------------------------------------------------------------
    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        self._json("POST", "/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})

    def resume(self) -> None:
        self._json("POST", "/resume")

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> Any:
        return self._json(
            "POST",
            "/collective_rpc",
            json={"method": method, "args": [], "kwargs": kwargs or {}, "timeout": self.timeout},
            timeout=self.timeout,
        )

    def reset_prefix_cache(self) -> None:
        self._json("POST", "/reset_prefix_cache")

    def update_weight_version(self, version: str) -> None:
        self._json("POST", "/update_weight_version", json={"new_version": version}, allow_404=True)

    def weight_version(self) -> str | None:
        data = self._json("GET", "/weight_info", allow_404=True)
        return str(data["weight_version"]) if isinstance(data, dict) and "weight_version" in data else None

    # -- NCCL weight transfer (vllm-rl-api.md 1.3) ----------------------------------------------------------
    def world_size(self) -> int:
        """Inference workers that join the NCCL group (``GET /get_world_size``)."""
        return int(self._json("GET", "/get_world_size")["world_size"])

    def init_weight_transfer_engine(self, init_info: dict[str, Any], timeout: float) -> None:
        """Blocks until every worker joined the rendezvous: call it while this side joins too."""
        self._json("POST", "/init_weight_transfer_engine", json={"init_info": init_info}, timeout=timeout)

    def start_weight_update(self) -> None:
        self._json("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any], timeout: float) -> None:
        """Returns once the workers received every tensor: call it while the broadcast runs."""
        self._json("POST", "/update_weights", json={"update_info": update_info}, timeout=timeout)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else {}
        self._json("POST", "/finish_weight_update", json=body)

    def shutdown_weight_transfer_engine(self) -> None:
        self._json("POST", "/shutdown_weight_transfer_engine", allow_404=True)

    # -- internals -----------------------------------------------------------------------------------------
    def _json(
        self, method: str, path: str, *, allow_404: bool = False, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        try:
            resp = self._client.request(method, path, timeout=timeout or httpx.USE_CLIENT_DEFAULT, **kwargs)
        except httpx.HTTPError as e:
            raise ServerControlError(f"{method} {self.base_url}{path} failed: {type(e).__name__}: {e}") from e
        if resp.status_code == 404 and allow_404:
            return None
        if resp.status_code == 404 and path in (
            "/pause",
            "/resume",
            "/collective_rpc",
            "/reset_prefix_cache",
            "/get_world_size",
            "/init_weight_transfer_engine",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
        ):
            raise UserError(
                f"{self.base_url}{path} does not exist: start vLLM with VLLM_SERVER_DEV_MODE=1 (the "
                "weight-update routes are development routes)."
            )
        if resp.status_code != 200:
            raise ServerControlError(
                f"{method} {self.base_url}{path} answered HTTP {resp.status_code}: {resp.text[:500]}"
            )
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text
