"""Tools: ``rollout.tools`` turned into schema-carrying ``Tool`` objects, and one turn's calls run against them.

Rules (reference section m.2):

- A tool is a plain function, sync or async, with a type hint on every argument and a Google-style docstring
  whose ``Args:`` section describes each one; its schema comes from ``transformers.utils.get_json_schema``. The
  model calls it by its ``__name__``; two tools of one rollout may not share a name.
- ``rollout.tools`` entries are registered names (kind ``tool``) or ``module:function`` import paths. Each must be
  a module-level function that pickles, since the rollout process is spawned: no lambda, no closure, no function
  defined inside another. Environment methods join as bound methods through ``tool_from_callable``.
- The calls of one assistant turn run **sequentially, in the order the model wrote them**. A sync tool runs on the
  given executor (the rollout process's tool thread pool), so a slow tool delays only its own rollout; an async
  tool is awaited on the event loop. Several rollouts' sync tools can run at once: tools touching shared state
  must be thread-safe.
- A failed call never fails the rollout: an unknown name (a policy error), a malformed call, a tool that raised
  (``TypeError`` from bad arguments included) or one past ``timeout_s`` gives an ``error: ...`` tool message the
  model can read, and the episode goes on.

Metrics (reference g.4), all items of the rollout process's ``MetricWindow``: ``tools/latency_s`` and
``tools/{name}/latency_s`` (mean over executed calls), ``tools/{name}/call_count`` and
``tools/{name}/failure_count`` (summed; per call of a known tool), ``tools/unknown_name_count`` (summed; 0 or 1
per call) and ``tools/parallel_calls_mean`` (calls per assistant turn that calls tools). Names the model made up
never become metric names.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import pickle
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli import registry
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.agent.tool_calls import ToolCall

CONFIG_KEY = "rollout.tools"


@dataclass
class Tool:
    """One function the model may call."""

    name: str
    """The function's ``__name__``: the model calls it by this name."""
    fn: Callable[..., Any]
    """A plain function or a bound method (environment tools)."""
    is_async: bool
    """True for an ``async def``: awaited on the event loop; otherwise run on the tool executor."""
    schema: dict[str, Any]
    """``get_json_schema(fn)``: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    key: str
    """Where it came from, for messages: ``rollout.tools[1]`` or ``environment game (GameEnv.move)``."""


def tool_from_callable(fn: Callable[..., Any], key: str) -> Tool:
    """A ``Tool`` of ``fn`` (a function or a bound method); ``key`` names its origin in errors."""
    # Imported here: checking a config (``asyncgrpo check``) must not import transformers.
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        raise UserError(f"{key}: {fn!r} has no __name__; a tool must be a function (def) or a method")
    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException, TypeError, ValueError) as e:
        raise UserError(
            f"{key}: cannot build the schema of tool {name!r}: {e}. A tool needs a type hint on every argument "
            "and a Google-style docstring: a summary line, then an 'Args:' section with one 'name: description' "
            "line per argument"
        ) from e
    return Tool(name=name, fn=fn, is_async=inspect.iscoroutinefunction(fn), schema=schema, key=key)


def load_tools(entries: list[str]) -> list[Tool]:
    """The tools of ``rollout.tools`` (registered names or ``module:function`` paths), checked and unique."""
    tools = []
    for i, entry in enumerate(entries):
        key = f"{CONFIG_KEY}[{i}]"
        try:
            fn = registry.resolve("tool", entry)
        except UserError as e:
            raise UserError(f"{key} ({entry!r}): {str(e).removeprefix(CONFIG_KEY + ': ')}") from e
        _check_module_level(fn, key, entry)
        tools.append(tool_from_callable(fn, key))
    check_unique(tools)
    return tools


def _check_module_level(fn: Any, key: str, entry: str) -> None:
    """A module-level function that pickles by reference into the spawned rollout process."""
    if not inspect.isfunction(fn):
        raise UserError(
            f"{key} ({entry!r}) is a {type(fn).__name__}, not a function: a tool must be a function defined "
            "with def (or async def) at module level"
        )
    qualname = fn.__qualname__
    if "<lambda>" in qualname:
        raise UserError(
            f"{key} ({entry!r}): a lambda cannot be pickled into the rollout process: "
            "define it with def at module level"
        )
    if "<locals>" in qualname:
        raise UserError(
            f"{key} ({entry!r}): {qualname} is defined inside another function (a closure or nested function) "
            "and cannot be pickled into the rollout process: define it with def at module level"
        )
    module = sys.modules.get(fn.__module__)
    if module is None or getattr(module, fn.__name__, None) is not fn:
        raise UserError(
            f"{key} ({entry!r}): module {fn.__module__!r} has no attribute {fn.__name__!r} that is this "
            "function (renamed, or wrapped by a decorator without functools.wraps), so it cannot be pickled "
            "into the rollout process: define the tool with def at module level under the name the model calls"
        )
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise UserError(
            f"{key} ({entry!r}): {qualname} cannot be pickled into the rollout process ({e}): "
            "define it with def at module level"
        ) from e


def check_unique(tools: list[Tool]) -> None:
    """Every tool name once: the model calls tools by name."""
    seen: dict[str, Tool] = {}
    for tool in tools:
        first = seen.setdefault(tool.name, tool)
        if first is not tool:
            raise UserError(
                f"{first.key} and {tool.key} both define a tool named {tool.name!r}; the model calls tools by "
                "name: rename one of them or remove the duplicate"
            )


@dataclass
class ToolResult:
    """What one call gave back."""

    name: str
    """The called name as the model wrote it ("" for a call whose name could not be read)."""
    content: str
    """What goes back to the model: the tool's result, or ``error: ...``."""
    failed: bool
    """Unknown name, malformed call, the tool raised, or it timed out."""
    unknown: bool
    """A well-formed call of a name that is not a tool of this rollout (a policy error)."""
    latency_s: float
    """Time the tool ran (0.0 when it did not run)."""

    def message(self) -> dict[str, str]:
        """The tool message appended to the conversation."""
        return {"role": "tool", "name": self.name, "content": self.content}


_TIMED_OUT = object()


async def run_tool_calls(
    calls: list[ToolCall],
    tools: Mapping[str, Tool],
    executor: Executor | None,
    metrics: MetricWindow | None,
    timeout_s: float | None,
) -> list[ToolResult]:
    """Run one assistant turn's calls one after another, in order; one ``ToolResult`` per call.

    A sync tool runs on ``executor`` (``None``: the loop's default executor), an async one is awaited. Each call
    is bounded by ``timeout_s`` (``None``: unbounded). A timed-out async tool is cancelled; a timed-out sync
    tool's thread cannot be killed: it runs on in the background, holding an executor thread until it returns,
    while the rollout goes on with a failed result. Cancelling the caller cancels the running call likewise.
    """
    results = []
    for call in calls:
        result = await _run_one(call, tools, executor, timeout_s)
        results.append(result)
        if metrics is not None:
            _record(metrics, call, result, tools)
    if metrics is not None and calls:
        metrics.add("tools/parallel_calls_mean", len(calls))
    return results


async def _run_one(
    call: ToolCall, tools: Mapping[str, Tool], executor: Executor | None, timeout_s: float | None
) -> ToolResult:
    if call.error is not None:
        return ToolResult(call.name, f"error: malformed tool call: {call.error}", True, False, 0.0)
    tool = tools.get(call.name)
    if tool is None:
        available = ", ".join(sorted(tools)) or "none"
        content = f"error: there is no tool named {call.name!r}; available tools: {available}"
        return ToolResult(call.name, content, True, True, 0.0)
    start = time.perf_counter()
    try:
        value = await _invoke(tool, call.arguments, executor, timeout_s)
    except Exception as e:
        text = str(e)
        content = f"error: {type(e).__name__}: {text}" if text else f"error: {type(e).__name__}"
        return ToolResult(call.name, content, True, False, time.perf_counter() - start)
    latency = time.perf_counter() - start
    if value is _TIMED_OUT:
        content = f"error: the tool {call.name!r} did not return within {timeout_s:g} s"
        return ToolResult(call.name, content, True, False, latency)
    return ToolResult(call.name, _as_text(value), False, False, latency)


async def _invoke(tool: Tool, arguments: dict[str, Any], executor: Executor | None, timeout_s: float | None):
    """The tool's return value, ``_TIMED_OUT``, or the tool's exception raised here."""
    if tool.is_async:
        future = asyncio.ensure_future(tool.fn(**arguments))
    else:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(executor, functools.partial(tool.fn, **arguments))
    # asyncio.wait, not wait_for: a tool raising TimeoutError itself must read as the tool's error, not a timeout.
    try:
        done, _ = await asyncio.wait({future}, timeout=timeout_s)
    except asyncio.CancelledError:
        future.cancel()
        raise
    if not done:
        future.cancel()
        return _TIMED_OUT
    return future.result()


def _as_text(value: Any) -> str:
    """A str as is; anything else as JSON (``str()`` when it does not serialize)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _record(metrics: MetricWindow, call: ToolCall, result: ToolResult, tools: Mapping[str, Tool]) -> None:
    metrics.add("tools/unknown_name_count", 1.0 if result.unknown else 0.0)
    if call.name not in tools:
        return
    metrics.add(f"tools/{call.name}/call_count", 1.0)
    metrics.add(f"tools/{call.name}/failure_count", 1.0 if result.failed else 0.0)
    if call.error is None:  # it ran
        metrics.add("tools/latency_s", result.latency_s)
        metrics.add(f"tools/{call.name}/latency_s", result.latency_s)
