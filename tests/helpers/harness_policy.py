"""A recording proxy wired the way the rollout process wires it, in front of a scripted ``FakeVllmServer``.

``ProxyRig`` builds the proxy with ``build_harness`` (the production ``Policy``: the loop's ``render`` through the
tiny tokenizer with the ChatML training template, decoding without special tokens, the configured tool-call
parser) and a real ``CompletionClient`` as ``generate`` (the loop's ``generate_one_turn`` for a run without
sampling masks). The proxy serves on its own event loop in a daemon thread, so a test drives it with the
synchronous ``openai`` client over real HTTP. Everything it starts it stops in ``stop()``::

    rig = ProxyRig(tok, Replies(tok, ["<tool_call>...</tool_call>", "It is 12."])).start()
    try:
        trace = rig.open()
        OpenAI(base_url=rig.base_url, api_key=trace.token).chat.completions.create(...)
    finally:
        rig.stop()
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from asyncgrpo_cli.config.harness import HarnessConfig
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.model.tiny import build_tiny_tokenizer
from asyncgrpo_cli.rollout.agent.templates import choose_chat_template
from asyncgrpo_cli.rollout.client import CompletionClient, SamplingParams
from asyncgrpo_cli.rollout.harness.proxy import RecordingProxy
from asyncgrpo_cli.rollout.harness.runner import build_harness
from asyncgrpo_cli.rollout.harness.trace import Trace
from asyncgrpo_cli.samples import TurnRecord
from tests.helpers.fake_server import FakeVllmServer


def training_tokenizer() -> Any:
    """The tiny tokenizer with the ChatML training template a run with tools or a harness swaps in."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = choose_chat_template(tokenizer, {}, False).template
    return tokenizer


SERVED_MODEL = "policy"
TEMPERATURE = 1.0
MAX_COMPLETION_LENGTH = 256


class Replies:
    """A ``FakeVllmServer`` reply script: the i-th request gets the i-th text's ids plus eos (it stopped); a
    reply given as a list of ids is sent as is (``[]``: no sampled token). Records ``(prompt_ids, max_tokens)``
    of every request."""

    def __init__(self, tok: Any, replies: list[str | list[int]]):
        self.tok = tok
        self.replies = list(replies)
        self.requests: list[tuple[list[int], int]] = []

    def __call__(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        i = len(self.requests)
        if i >= len(self.replies):
            raise IndexError(f"request {i + 1} has no scripted reply ({len(self.replies)} scripted)")
        self.requests.append((list(prompt_ids), max_tokens))
        reply = self.replies[i]
        ids = list(reply) if isinstance(reply, list) else self.tok.encode(reply) + [self.tok.eos_token_id]
        return ids


class ProxyRig:
    def __init__(
        self,
        tok: Any,
        reply: Any,
        *,
        max_model_len: int = 2048,
        num_topk: int = 0,
        tool_call_format: str = "hermes",
    ):
        self.tok = tok
        self.num_topk = num_topk
        self.fake = FakeVllmServer(
            reply=reply, eos_token_id=tok.eos_token_id, max_model_len=max_model_len, model=SERVED_MODEL
        )
        self.metrics = MetricWindow()
        self.settings = SimpleNamespace(
            sampling=SimpleNamespace(
                temperature=TEMPERATURE,
                top_p=1.0,
                top_k=0,
                min_p=0.0,
                repetition_penalty=1.0,
                max_completion_length=MAX_COMPLETION_LENGTH,
            ),
            rollout=SimpleNamespace(
                tool_call_format=tool_call_format,
                harness=HarnessConfig(command=["true"]),
                max_concurrent_rollouts=4,
            ),
            max_model_len=max_model_len,
            sampling_mask=False,
            served_model=SERVED_MODEL,
        )
        self.proxy: RecordingProxy | None = None
        self.client: CompletionClient | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="harness-proxy")

    # ------------------------------------------------------------------ the loop's pieces
    def render(self, messages: list[dict[str, Any]], tools: Any = None, **template_kwargs: Any) -> list[int]:
        """``AsyncRolloutLoop.render`` (no ``model.chat_template_kwargs``)."""
        extra = {"tools": tools} if tools else {}
        out = self.tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **extra, **template_kwargs
        )
        return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]

    async def generate(self, prompt_ids: list[int], max_tokens: int | None = None) -> TurnRecord:
        """``AsyncRolloutLoop.generate_one_turn`` without sampling masks."""
        s = self.settings.sampling
        params = SamplingParams(
            max_tokens=s.max_completion_length if max_tokens is None else max_tokens,
            temperature=s.temperature,
            num_logprobs=self.num_topk,
        )
        assert self.client is not None
        return await self.client.complete(prompt_ids, params, None)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ProxyRig:
        self.fake.start()
        self._thread.start()
        self.call(self._start())
        return self

    async def _start(self) -> None:
        self.client = CompletionClient(
            self.fake.base_url, SERVED_MODEL, timeout=10.0, max_retries=0, max_connections=4
        )
        runner = build_harness(self.settings, self.tok, self.metrics, self.render, self.generate)
        self.proxy = runner.proxy
        await self.proxy.start()

    async def _stop(self) -> None:
        if self.proxy is not None:
            await self.proxy.close()
        if self.client is not None:
            await self.client.close()

    def stop(self) -> None:
        try:
            if self._thread.is_alive():
                self.call(self._stop())
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)
            if not self._loop.is_running():
                self._loop.close()
        finally:
            self.fake.stop()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        """Run a coroutine on the proxy's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ traces
    @property
    def base_url(self) -> str:
        assert self.proxy is not None
        return self.proxy.base_url

    def open(self) -> Trace:
        """A rollout's trace (its token is the API key), opened on the proxy's loop as the runner does."""

        async def op() -> Trace:
            assert self.proxy is not None
            return self.proxy.traces.open()

        return self.call(op())

    def close(self, trace: Trace) -> int:
        """End the rollout of ``trace`` (its token expires); returns the requests it cancelled."""

        async def op() -> int:
            assert self.proxy is not None
            return self.proxy.traces.close(trace)

        return self.call(op())

    def counts(self) -> dict[str, float]:
        """The proxy's metrics so far (read on its loop)."""

        async def op() -> dict[str, float]:
            return self.metrics.reduce()

        return self.call(op())


def gone(pid: int) -> bool:
    """No process ``pid`` any more, or only its zombie (dead, not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")
