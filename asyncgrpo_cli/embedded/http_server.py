"""The embedded server's HTTP layer: starlette routes over the route table, served by uvicorn (vLLM's own stack).

Knows nothing of generation: a route is a plain ``(app, query, body) -> (status, payload)`` function
(``app.ROUTES``) that may block (a generation waits for the engine thread), so each runs in a worker thread of
its own limiter, never on the event loop. A payload is a JSON object, Prometheus text (``str``) or None (an
empty body). Errors are vLLM's JSON error bodies (``ApiError.body()``), 404 and 405 included.

``bind`` takes the port before anything heavy loads (a busy port fails fast); ``start`` serves it from a
uvicorn thread; ``stop`` ends it. TCP_NODELAY is on for every connection (asyncio and uvloop set it), so a
response leaves at once, not after the client's 40 ms delayed ACK.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as StarletteRoute

from asyncgrpo_cli.embedded.api import ApiError
from asyncgrpo_cli.embedded.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from asyncgrpo_cli.errors import UserError

log = logging.getLogger("asyncgrpo.server")

Payload = dict[str, Any] | str | None
Route = Callable[[Any, dict[str, str], bytes], tuple[int, Payload]]

SERVER_HEADER = "asyncgrpo-embedded"
WORKER_THREADS = 512
"""Route calls in flight at once (each waiting request holds a thread); starlette's default of 40 would queue
requests the engine could batch."""
KEEP_ALIVE_S = 600
"""Seconds an idle keep-alive connection is held open (the rollout client keeps a pool)."""


class PortInUseError(UserError):
    """The configured port is taken (``main`` exits with status 3)."""


def response(status: int, payload: Payload) -> Response:
    if payload is None:
        data, ctype = b"", "application/json"
    elif isinstance(payload, str):
        data, ctype = payload.encode(), METRICS_CONTENT_TYPE
    else:
        data, ctype = json.dumps(payload).encode(), "application/json"
    return Response(data, status_code=status, headers={"content-type": ctype})


def asgi_app(routes: dict[tuple[str, str], Route], server: EmbeddedHTTPServer) -> Starlette:
    """One starlette route per path; its methods dispatch to the route functions, called with ``server.app``."""
    by_path: dict[str, dict[str, Route]] = defaultdict(dict)
    for (method, path), fn in routes.items():
        by_path[path][method] = fn
    limiter: list[anyio.CapacityLimiter] = []  # made on the event loop, at the first request

    def endpoint(methods: dict[str, Route]) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response:
            fn = methods[
                "GET" if request.method == "HEAD" else request.method
            ]  # starlette checked the method
            try:
                query = {k: v[-1] for k, v in parse_qs(request.url.query).items()}
                body = await request.body()
                if not limiter:
                    limiter.append(anyio.CapacityLimiter(WORKER_THREADS))
                status, payload = await anyio.to_thread.run_sync(
                    fn, server.app, query, body, limiter=limiter[0]
                )
            except ApiError as e:
                status, payload = e.status, e.body()
            except Exception as e:  # a bug: answer 500 with the message rather than dropping the connection
                log.exception("%s %s failed", request.method, request.url.path)
                status, payload = 500, ApiError(f"{type(e).__name__}: {e}", 500, "InternalServerError").body()
            return response(status, payload)

        return handle

    async def refused(request: Request, exc: Exception) -> Response:
        """404 (no such path) and 405 (no such method on it) as vLLM-style JSON errors."""
        where = f"{request.method} {request.url.path}"
        if getattr(exc, "status_code", 404) == 405:
            err = ApiError(f"Method Not Allowed: {where}", 405, "MethodNotAllowed")
        else:
            err = ApiError(f"Not Found: {where}", 404, "NotFoundError")
        return response(err.status, err.body())

    app = Starlette(
        routes=[StarletteRoute(path, endpoint(m), methods=list(m)) for path, m in by_path.items()],
        exception_handlers={404: refused, 405: refused},
    )
    app.router.redirect_slashes = False  # /health/ is a 404 as before, not a redirect
    return app


class EmbeddedHTTPServer:
    """A bound listening socket and the uvicorn server that serves the route table on it from a thread.

    Set ``app`` (the ``EmbeddedApp`` the routes receive) before ``start()``.
    """

    def __init__(self, sock: socket.socket, routes: dict[tuple[str, str], Route]):
        self.socket = sock
        self.server_address: tuple[str, int] = sock.getsockname()[:2]
        self.app: Any = None
        self._routes = routes
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self, timeout: float = 30.0) -> EmbeddedHTTPServer:
        """Serve from a daemon thread; returns once uvicorn accepts connections."""
        config = uvicorn.Config(
            asgi_app(self._routes, self),
            lifespan="off",
            log_config=None,  # the process's logging as it is
            log_level="warning",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=5,
            server_header=False,
            headers=[("server", SERVER_HEADER)],
            backlog=256,
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self.socket]}, daemon=True, name="embedded-http"
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("the embedded HTTP server stopped while starting (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the embedded HTTP server did not start within {timeout:g}s")
            time.sleep(0.01)
        return self

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, finish the responses in flight (5 s at most), close the socket. Idempotent."""
        if self._uvicorn is not None and self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout)
        self.socket.close()


def bind(host: str, port: int, routes: dict[tuple[str, str], Route]) -> EmbeddedHTTPServer:
    """Bind the listening socket (port 0 picks a free port); a taken port raises ``PortInUseError``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server: TIME_WAIT does not block
        sock.bind((host, port))
        sock.listen(256)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"server.embedded.port: port {port} on {host} is already in use; pick another port "
                "(server.embedded.port=N) or 0 for a free one."
            ) from None
        raise
    return EmbeddedHTTPServer(sock, routes)
