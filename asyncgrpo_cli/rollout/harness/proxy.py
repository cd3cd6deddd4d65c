"""The recording proxy: an OpenAI-compatible server in the rollout process, in front of the policy server.

Harness processes talk to it (``OPENAI_BASE_URL``); it renders their chat requests with the run's chat template
(the training template the tool loop uses), samples through the rollout loop's ``generate_one_turn`` (token ids
to the policy server, with the sampler log-probs, top-k and sampling masks of every other request), records each
request in the rollout's :class:`~asyncgrpo_cli.rollout.harness.trace.Trace`, and answers in OpenAI's shape
(``openai_api``). Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Security: it binds 127.0.0.1 only, and a request must carry the bearer token of a rollout in flight
(``OPENAI_API_KEY``); an unknown or expired token gets 401 (``harness/unauthorized_count``). Refused requests
(``openai_api``'s rules) get 400 naming the field (``harness/rejected_request_count``).

Length: a request whose prompt plus ``max_tokens`` does not fit the server's ``max_model_len`` gets 400
``context_length_exceeded``, as vLLM answers; without ``max_tokens`` the reply may use the room left (with
sampling masks the server stops at ``max_model_len`` itself, so an explicit ``max_tokens`` is lowered to fit).

Served by uvicorn on the loop's own event loop (no thread hop: handlers await the loop's HTTP client directly);
uvicorn's signal capture is turned off, the rollout process owns its signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.agent.tool_calls import ParsedReply, ToolCallParser
from asyncgrpo_cli.rollout.client import ServerRequestError
from asyncgrpo_cli.rollout.harness import openai_answers as answers
from asyncgrpo_cli.rollout.harness import openai_api as api
from asyncgrpo_cli.rollout.harness.trace import Trace
from asyncgrpo_cli.samples import TurnRecord

log = logging.getLogger(__name__)

REQUEST_FAULTS = (400, 413, 422)
"""Policy-server statuses that blame the request: refused to the agent (400 ``upstream_rejected``). Any other
failure stops the run, as it would a tool loop (a 404 model name or a 401 is how the server was started)."""
EXPIRED_TOKENS_KEPT = 4096
"""Tokens of ended rollouts remembered, to tell an expired token from an unknown one in the 401."""


@dataclass
class Policy:
    """What the proxy needs from the rollout loop."""

    render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]], list[int]]
    tokenize: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    token_text: Callable[[int], str]
    generate: Callable[[list[int], int], Awaitable[TurnRecord]]
    """``(prompt_ids, max_tokens)`` -> the sampled turn (``AsyncRolloutLoop.generate_one_turn``)."""
    parser: ToolCallParser
    sampling: api.RunSampling
    max_model_len: int
    sampling_mask: bool
    served_model: str
    vocab_size: int
    """Token ids a ``/v1/completions`` prompt may hold (``len(tokenizer)``)."""


class TraceTable:
    """The traces of the rollouts in flight, by token."""

    def __init__(self) -> None:
        self.active: dict[str, Trace] = {}
        self.expired: OrderedDict[str, Trace] = OrderedDict()
        """Tokens of ended rollouts -> their (released) traces, the last ``EXPIRED_TOKENS_KEPT``."""

    def open(self) -> Trace:
        """A new trace; call it from the rollout's task: its requests are sampled in a copy of that task's
        context (the group's model name under LoRA sync, ``rollout/served_name.py``)."""
        trace = Trace(token=f"agrpo-{secrets.token_urlsafe(24)}", context=contextvars.copy_context())
        self.active[trace.token] = trace
        return trace

    def close(self, trace: Trace) -> int:
        """Expire the trace's token and cancel its requests in flight (how many); idempotent."""
        if self.active.pop(trace.token, None) is None:
            return trace.close()
        self.expired[trace.token] = trace
        while len(self.expired) > EXPIRED_TOKENS_KEPT:
            self.expired.popitem(last=False)
        return trace.close()

    def lookup(self, authorization: str | None) -> Trace:
        token = ""
        if authorization and authorization.lower().startswith("bearer "):
            token = authorization[7:].strip()
        trace = self.active.get(token)
        if trace is not None:
            return trace
        if token in self.expired:
            self.expired[token].request_after_exit()
            raise api.Rejected(
                None,
                "this API key belongs to a rollout that has ended: requests after the harness exited are "
                "not served.",
                status=401,
                code="expired_api_key",
            )
        raise api.Rejected(
            None,
            "unknown API key: send the OPENAI_API_KEY the harness was started with.",
            status=401,
            code="invalid_api_key",
        )


class RecordingProxy:
    def __init__(self, policy: Policy, metrics: MetricWindow):
        self.policy = policy
        self.metrics = metrics
        self.traces = TraceTable()
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self._socket: socket.socket | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/{path:path}", self._unknown, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
            ]
        )

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        assert self._socket is not None, "the proxy is not started"
        return f"http://127.0.0.1:{self._socket.getsockname()[1]}/v1"

    async def start(self, timeout: float = 30.0) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        deadline = asyncio.get_running_loop().time() + timeout
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the harness proxy stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the harness proxy did not start within {timeout:.0f}s")
            await asyncio.sleep(0.01)

    async def close(self, timeout: float = 5.0) -> None:
        for trace in list(self.traces.active.values()):
            self.traces.close(trace)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except (asyncio.TimeoutError, Exception):
                self._server.force_exit = True
                self._task.cancel()
        if self._socket is not None:
            self._socket.close()
        self._server = self._task = self._socket = None

    # ------------------------------------------------------------------ routes
    async def _models(self, request: Request) -> Response:
        try:
            self.traces.lookup(request.headers.get("authorization"))
        except api.Rejected as e:
            return self._refused(e)
        model = {"id": self.policy.served_model, "object": "model", "created": 0, "owned_by": "asyncgrpo"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _unknown(self, request: Request) -> Response:
        path = request.url.path
        hint = (
            " (the OpenAI Agents SDK and Codex default to the Responses API: switch them to chat completions, "
            "e.g. agents.set_default_openai_api('chat_completions'))"
            if path.rstrip("/").endswith("/responses")
            else ""
        )
        return self._refused(
            api.Rejected(
                None,
                f"{request.method} {path} is not served: the proxy serves POST /v1/chat/completions, POST "
                f"/v1/completions and GET /v1/models{hint}.",
                status=404,
                code="unknown_route",
            )
        )

    async def _chat(self, request: Request) -> Response:
        try:
            trace = self.traces.lookup(request.headers.get("authorization"))
            req = api.parse_chat(await _json(request), self.policy.sampling)
            self._count_ignored(req.ignored)
            messages = self._as_sampled(trace, req.messages)
            try:
                prompt_ids = self.policy.render(messages, req.tools, req.template_kwargs)
            except Exception as e:  # a template error on these messages: the agent's to fix, not the run's
                raise api.Rejected(
                    "messages", f"the chat template cannot render these messages ({type(e).__name__}: {e})."
                ) from None
            turn = await self._sample(trace, prompt_ids, req.max_tokens, req.explicit_max_tokens, "messages")
            await self._deliverable(trace, request)
        except api.Rejected as e:
            return self._refused(e)
        text = self.policy.decode(turn.output_ids)
        reply = self.policy.parser.parse(text) if req.tools else ParsedReply(text, [])
        message = answers.assistant_message(reply)
        trace.record_chat(turn, req.raw_messages, message, text)
        logprobs = None
        if req.logprobs:
            tokens, lps, tops = self._logprobs(turn, req.top_logprobs)
            logprobs = answers.chat_logprobs(tokens, lps, tops)
        answer = answers.chat_response(
            req.model or self.policy.served_model,
            message,
            answers.finish_reason(turn.finish_reason, message),
            len(prompt_ids),
            len(turn.output_ids),
            logprobs,
        )
        if req.stream:
            return Response(
                answers.sse(answers.chat_stream_events(answer, req.include_usage)),
                media_type="text/event-stream",
            )
        return JSONResponse(answer)

    async def _completions(self, request: Request) -> Response:
        try:
            trace = self.traces.lookup(request.headers.get("authorization"))
            req = api.parse_completion(await _json(request), self.policy.sampling)
            self._count_ignored(req.ignored)
            prompt_ids = (
                list(req.prompt) if isinstance(req.prompt, list) else self.policy.tokenize(req.prompt)
            )
            bad = [t for t in prompt_ids if not 0 <= t < self.policy.vocab_size]
            if bad:
                raise api.Rejected(
                    "prompt",
                    f"prompt holds token id {bad[0]}, outside the vocabulary [0, {self.policy.vocab_size}).",
                )
            turn = await self._sample(trace, prompt_ids, req.max_tokens, req.explicit_max_tokens, "prompt")
            await self._deliverable(trace, request)
        except api.Rejected as e:
            return self._refused(e)
        text = self.policy.decode(turn.output_ids)
        trace.record_completion(turn, text)
        logprobs = None
        if req.logprobs:
            logprobs = answers.completion_logprobs(*self._logprobs(turn, req.logprobs))
        answer = answers.completion_response(
            req.model or self.policy.served_model,
            text,
            answers.finish_reason(turn.finish_reason, {}),
            len(prompt_ids),
            len(turn.output_ids),
            logprobs,
        )
        if req.stream:
            return Response(
                answers.sse(answers.completion_stream_events(answer, req.include_usage)),
                media_type="text/event-stream",
            )
        return JSONResponse(answer)

    # ------------------------------------------------------------------ helpers
    def _refused(self, e: api.Rejected) -> Response:
        if e.code == "disconnected":  # nobody reads this answer
            return Response(status_code=e.status)
        self.metrics.add(
            "harness/unauthorized_count" if e.status == 401 else "harness/rejected_request_count", 1
        )
        if e.code == "expired_api_key":
            self.metrics.add("harness/late_request_count", 1)
        return JSONResponse(e.body(), status_code=e.status)

    def _as_sampled(self, trace: Trace, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every assistant message this trace answered, as the text that was sampled (``trace.py``)."""
        seen: dict[str, int] = {}
        out = []
        for m in messages:
            raw = trace.raw_text(m, seen)
            out.append(m if raw is None else {"role": "assistant", "content": raw})
        return out

    def _count_ignored(self, ignored: list[str]) -> None:
        if ignored:
            self.metrics.add("harness/ignored_field_count", len(ignored))

    async def _deliverable(self, trace: Trace, request: Request) -> None:
        """After sampling: the answer still has a reader. A harness that exited meanwhile, or a client that hung
        up (its own timeout; it may retry), did not get this turn, so it is not recorded."""
        if trace.closed:
            trace.request_after_exit()
            raise api.Rejected(
                None, "the rollout ended while this request was served.", status=401, code="expired_api_key"
            )
        if await request.is_disconnected():
            self.metrics.add("harness/disconnected_request_count", 1)
            raise api.Rejected(
                None, "the client disconnected before the answer.", status=499, code="disconnected"
            )

    def _budget(self, prompt_len: int, max_tokens: int, explicit: bool, param: str) -> int:
        room = self.policy.max_model_len - prompt_len
        if room >= max_tokens:
            return max_tokens
        if room > 0 and (not explicit or self.policy.sampling_mask):
            return room
        self.metrics.add("rollout/max_model_len_stop_count", 1)
        raise api.Rejected(
            param,
            f"this request has {prompt_len} prompt tokens and asks for {max_tokens} more, beyond the server's "
            f"max_model_len of {self.policy.max_model_len}: shorten the conversation (or lower max_tokens).",
            code="context_length_exceeded",
        )

    async def _sample(
        self, trace: Trace, prompt_ids: list[int], max_tokens: int, explicit: bool, param: str
    ) -> TurnRecord:
        """Sample one turn; ``param`` is the field a too-long prompt is refused under (messages / prompt)."""
        if trace.closed:  # the harness exited (this request came from a process it left, or was being read)
            trace.request_after_exit()
            raise api.Rejected(
                None, "the rollout ended before this request was served.", status=401, code="expired_api_key"
            )
        budget = self._budget(len(prompt_ids), max_tokens, explicit, param)
        task = trace.context.run(asyncio.create_task, self.policy.generate(prompt_ids, budget))
        trace.inflight.add(task)
        t0 = time.monotonic()
        try:
            return await task
        except asyncio.CancelledError:
            if task in trace.cancelled:  # the harness exited: answer its orphaned request instead of dying
                raise api.Rejected(
                    None,
                    "the rollout ended while this request was served.",
                    status=401,
                    code="expired_api_key",
                ) from None
            raise
        except ServerRequestError as e:
            if e.status in REQUEST_FAULTS:  # this request's fault (a 404 model, a 401 are the server's setup)
                raise api.Rejected(
                    None, f"the policy server refused this request: {e}", code="upstream_rejected"
                ) from None
            trace.server_error = e
            raise api.Rejected(
                None, f"the policy server failed: {e}", status=502, code="upstream_error"
            ) from None
        except Exception as e:  # the sampling path broke: the run stops with it, as a tool loop's would
            trace.server_error = e
            raise api.Rejected(
                None, f"sampling failed: {type(e).__name__}: {e}", status=502, code="upstream_error"
            ) from None
        finally:
            trace.inflight.discard(task)
            trace.sampling_s += time.monotonic() - t0

    def _logprobs(
        self, turn: TurnRecord, top: int
    ) -> tuple[list[str], list[float], list[dict[str, float]] | None]:
        text = self.policy.token_text
        tokens = [text(t) for t in turn.output_ids]
        lps = [float(x) for x in turn.output_log_probs] or [0.0] * len(tokens)
        tops = None
        if top and turn.output_sampler_logprobs:
            tops = [
                {text(t): float(v) for t, v in sorted(e.items(), key=lambda kv: -kv[1])[:top]}
                for e in turn.output_sampler_logprobs
            ]
        return tokens, lps, tops


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers (the rollout process keeps its own)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise api.Rejected(None, f"the request body is not JSON ({e}).") from None
