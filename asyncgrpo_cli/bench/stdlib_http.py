"""The embedded server's former HTTP layer (``http.server.ThreadingHTTPServer``, a thread per connection), kept
only so ``asyncgrpo bench embedded-server --http`` can measure it beside the shipped one (``embedded/http_server.py``)
on the same route table, app and engine. The product does not use it.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from asyncgrpo_cli.embedded.api import ApiError
from asyncgrpo_cli.embedded.http_server import METRICS_CONTENT_TYPE, Payload, Route

log = logging.getLogger("asyncgrpo.server")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "asyncgrpo-embedded"
    timeout = 600
    disable_nagle_algorithm = True  # headers and body leave at once, not after the client's 40 ms delayed ACK
    server: StdlibHTTPServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - overrides http.server
        log.debug("%s " + format, self.address_string(), *args)

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        routes = self.server.routes
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length > 0 else b""
            route = routes.get((method, url.path))
            if route is None:
                allowed = any(path == url.path for _, path in routes)
                raise ApiError(
                    f"{'Method Not Allowed' if allowed else 'Not Found'}: {method} {url.path}",
                    405 if allowed else 404,
                    "MethodNotAllowed" if allowed else "NotFoundError",
                )
            status, payload = route(self.server.app, query, body)
        except ApiError as e:
            status, payload = e.status, e.body()
        except Exception as e:
            log.exception("%s %s failed", method, url.path)
            status, payload = 500, ApiError(f"{type(e).__name__}: {e}", 500, "InternalServerError").body()
        self._send(status, payload)

    def _send(self, status: int, payload: Payload) -> None:
        if payload is None:
            data, ctype = b"", "application/json"
        elif isinstance(payload, str):
            data, ctype = payload.encode(), METRICS_CONTENT_TYPE
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if data:
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


class StdlibHTTPServer(ThreadingHTTPServer):
    """The same surface as ``EmbeddedHTTPServer``: ``app``, ``port``, ``start()``, ``stop()``."""

    daemon_threads = True
    request_queue_size = 256
    app: Any = None

    def __init__(self, host: str, port: int, routes: dict[tuple[str, str], Route]):
        super().__init__((host, port), _Handler)
        self.routes = routes
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> StdlibHTTPServer:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread = None
        self.server_close()
