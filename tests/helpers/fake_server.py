"""A small stdlib fake of the vLLM HTTP API, for fault injection (no mocked HTTP layer: real sockets, real HTTP).

Serves ``/health``, ``/v1/models``, ``/weight_info``, ``POST /update_weight_version``, scripted ``/metrics``
pages and ``/v1/completions`` with deterministic token ids and log-probs, plus the development routes a trainer's
disk weight sync drives (``GET /is_paused``, ``POST /pause``, ``/resume``, ``/collective_rpc``,
``/reset_prefix_cache``: recorded, nothing is loaded), so a real ``train`` run can point at it
(``server=vllm server.base_url=...``). Faults: fail the next N requests of a route with a status, drop the
connection without answering, or ``stop()`` and ``start()`` again on the same port (a restart: the weight version
goes back to ``"default"``, as on a real server)::

    with FakeVllmServer(metrics=[page(usage=0.3)]) as srv:
        srv.fail("/v1/completions", times=2, status=503)
        ...

Scripted completions: ``reply(prompt_ids, max_tokens) -> list[int] | None`` picks a request's output tokens
(None: the default deterministic ones). Scripted ids longer than ``max_tokens`` are cut there and finish with
``"length"``; others finish with ``"stop"`` when they end with ``eos_token_id``, else ``"length"`` (the default
tokens always finish with ``"length"``). A ``reply`` that raises answers 400 with the error: the client stops the run with it instead of retrying (as it
would a 5xx) into a later call of the script::

    FakeVllmServer(reply=lambda ids, n: tok.encode("42") + [eos], eos_token_id=eos)

Runs in a daemon thread of the test process; every blocking call has a timeout.
"""

from __future__ import annotations

import json
import socket
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

DROP = -1
"""A status for ``fail``: close the connection without sending a response."""
VOCAB = 1000
Reply = Callable[[list[int], int], list[int] | None]
"""A completion script: ``(prompt_ids, max_tokens) -> output ids`` (None: the default deterministic tokens)."""


def completion_tokens(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The fake's deterministic output for a prompt: a function of the prompt's tokens."""
    base = sum(int(t) for t in prompt)
    return [(base + 7 * i) % VOCAB for i in range(max_tokens)]


def token_logprob(token: int) -> float:
    return -0.25 - (token % 10) / 10.0


def metrics_page(
    usage: float | Sequence[float] = 0.0,
    running: float | Sequence[float] = 0,
    waiting: float | Sequence[float] = 0,
    preemptions: float | Sequence[float] = 0,
    kv_cache_tokens: int | None = 8192,
    block_size: int = 16,
    model: str = "fake",
) -> str:
    """A ``/metrics`` page in vLLM's format; a sequence value gives one series per engine."""

    def per_engine(v: float | Sequence[float]) -> list[float]:
        return list(v) if isinstance(v, Sequence) else [v]

    usages = per_engine(usage)
    n = len(usages)
    cols = {
        "vllm:num_requests_running": ("gauge", per_engine(running)),
        "vllm:num_requests_waiting": ("gauge", per_engine(waiting)),
        "vllm:kv_cache_usage_perc": ("gauge", usages),
        "vllm:num_preemptions_total": ("counter", per_engine(preemptions)),
    }
    lines = []
    for name, (kind, values) in cols.items():
        lines += [f"# HELP {name} {name}.", f"# TYPE {name} {kind}"]
        for e in range(n):
            lines.append(f'{name}{{engine="{e}",model_name="{model}"}} {float(values[e % len(values)])}')
    lines += [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
    ]
    for e in range(n):
        tokens = "None" if kv_cache_tokens is None else str(kv_cache_tokens)
        blocks = "None" if kv_cache_tokens is None else str(kv_cache_tokens // block_size)
        lines.append(
            f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",engine="{e}",'
            f'kv_cache_size_tokens="{tokens}",num_gpu_blocks="{blocks}",num_cpu_blocks="None"}} 1.0'
        )
    return "\n".join(lines) + "\n"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    fake: FakeVllmServer

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, addr = super().get_request()
        with self.fake._lock:
            self.fake._conns.add(conn)
        return conn, addr

    def shutdown_request(self, request: Any) -> None:
        with self.fake._lock:
            self.fake._conns.discard(request)
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence the default stderr log
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        fake: FakeVllmServer = self.server.fake  # type: ignore[attr-defined]
        path = urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        status, payload = fake._answer(method, path, body)
        if status == DROP:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain; version=0.0.4; charset=utf-8"
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True


class FakeVllmServer:
    """The fake server; ``base_url`` is stable across ``stop()`` / ``start()`` (same port)."""

    def __init__(
        self,
        metrics: Sequence[str | int] | None = None,
        model: str = "fake",
        max_model_len: int = 256,
        port: int = 0,
        completion_delay_s: float = 0.0,
        reply: Reply | None = None,
        eos_token_id: int | None = None,
    ):
        self.model = model
        self.max_model_len = max_model_len
        self.port = port
        self.completion_delay_s = completion_delay_s
        self.metrics_script: list[str | int] = list(metrics) if metrics else [metrics_page(model=model)]
        """``/metrics`` answers in order (the last repeats): a page, or an int status (e.g. 404)."""
        self.weight_version = "default"
        self.requests: Counter[str] = Counter()
        """Requests answered (or dropped) per path since the last (re)start."""
        self.completion_prompts: list[list[int]] = []
        self.reply = reply
        self.eos_token_id = eos_token_id
        """With ``reply``: scripted ids ending with it finish with ``"stop"``."""
        self.paused = False
        self.rpc_calls: list[dict[str, Any]] = []
        """``POST /collective_rpc`` bodies (``{"method", "kwargs", ...}``), in order (kept across restarts)."""
        self.starts = 0
        self._faults: dict[str, list[int]] = {}
        self._metrics_index = 0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._httpd is not None

    def start(self) -> FakeVllmServer:
        """Listen (again) on ``port``; a restart forgets the weight version and the request counts."""
        httpd = _Server(("127.0.0.1", self.port), _Handler, bind_and_activate=False)
        httpd.fake = self
        httpd.server_bind()
        httpd.server_activate()
        self.port = httpd.server_address[1]
        with self._lock:
            self.weight_version = "default"
            self.paused = False
            self.requests = Counter()
            self._metrics_index = 0
            self.starts += 1
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name="fake-vllm"
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection (what a crash looks like to clients)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeVllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- fault injection ---------------------------------------------------------------------------------------
    def fail(self, path: str, times: int, status: int = 503) -> None:
        """The next ``times`` requests to ``path`` answer ``status`` (``DROP``: the connection is closed)."""
        with self._lock:
            self._faults.setdefault(path, []).extend([status] * times)

    def script_metrics(self, pages: Sequence[str | int]) -> None:
        """Replace the ``/metrics`` script and start it from the beginning."""
        with self._lock:
            self.metrics_script = list(pages)
            self._metrics_index = 0

    # -- routes ------------------------------------------------------------------------------------------------
    def _answer(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        with self._lock:
            self.requests[path] += 1
            faults = self._faults.get(path)
            if faults:
                status = faults.pop(0)
                return status, {"error": {"message": f"injected failure {status}", "code": status}}
        if (method, path) == ("GET", "/health"):
            return 200, {}
        if (method, path) == ("GET", "/v1/models"):
            card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
            return 200, {"object": "list", "data": [card]}
        if (method, path) == ("GET", "/weight_info"):
            return 200, {"weight_version": self.weight_version}
        if (method, path) == ("POST", "/update_weight_version"):
            self.weight_version = str(json.loads(body or b"{}").get("new_version"))
            return 200, {"success": True, "new_version": self.weight_version}
        if (method, path) == ("GET", "/metrics"):
            with self._lock:
                item = self.metrics_script[min(self._metrics_index, len(self.metrics_script) - 1)]
                self._metrics_index += 1
            return (item, {"error": {"message": "scripted"}}) if isinstance(item, int) else (200, item)
        if (method, path) == ("POST", "/v1/completions"):
            return self._complete(json.loads(body or b"{}"))
        if (method, path) == ("GET", "/is_paused"):
            return 200, {"is_paused": self.paused}
        if (method, path) in (("POST", "/pause"), ("POST", "/resume")):
            self.paused = path == "/pause"
            return 200, {}
        if (method, path) == ("POST", "/collective_rpc"):
            with self._lock:
                self.rpc_calls.append(json.loads(body or b"{}"))
            return 200, {"results": [None]}
        if (method, path) == ("POST", "/reset_prefix_cache"):
            return 200, {}
        return 404, {"error": {"message": f"Not Found: {method} {path}"}}

    def _complete(self, req: dict[str, Any]) -> tuple[int, Any]:
        if self.completion_delay_s:
            threading.Event().wait(self.completion_delay_s)
        prompt = [int(t) for t in req.get("prompt", [])]
        with self._lock:
            self.completion_prompts.append(prompt)
        max_tokens = int(req.get("max_tokens", 16))
        try:
            out, finish = self._output(prompt, max_tokens)
        except Exception as e:  # a broken script: stop the client with the error (a 5xx would be retried)
            return 400, {"error": {"message": f"the fake's reply script raised {type(e).__name__}: {e}"}}
        n_top = int(req.get("logprobs") or 0)
        top = [
            {
                f"token_id:{t}": token_logprob(t),
                **{f"token_id:{(t + k) % VOCAB}": -5.0 - k for k in range(1, n_top)},
            }
            for t in out
        ]
        choice = {
            "index": 0,
            "text": "",
            "token_ids": out,
            "finish_reason": finish,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in out],
                "token_logprobs": [token_logprob(t) for t in out],
                "top_logprobs": top if n_top else None,
            },
        }
        return 200, {"id": "cmpl-fake", "object": "text_completion", "model": self.model, "choices": [choice]}

    def _output(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        """The output ids and finish reason of one request (scripted, or the default tokens)."""
        scripted = self.reply(prompt, max_tokens) if self.reply is not None else None
        if scripted is None:
            return completion_tokens(prompt, max_tokens), "length"
        ids = [int(t) for t in scripted]
        stops = bool(ids) and self.eos_token_id is not None and ids[-1] == self.eos_token_id
        if len(ids) > max_tokens:
            return ids[:max_tokens], "length"
        return ids, "stop" if stops else "length"
