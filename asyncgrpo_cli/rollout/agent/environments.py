"""Environments (``rollout.environment_factory``): one instance per rollout, reused across rollouts.

``environment_factory`` is one factory (a registered name or ``module:Class``) or a mapping ``{name: factory}``
that routes each dataset row by its ``environment`` column (:data:`ROUTE_COLUMN`). A factory is called with no
arguments; its product must have ``reset``. Reserved methods (never tools):

- ``reset(**row_columns) -> str | None`` starts a rollout. It receives the row's columns except ``environment``,
  only those its signature accepts (all of them when it takes ``**kwargs``). A returned string is appended to the
  last user message, or becomes the user message when the row has no prompt (``data.source=environment``).
- ``get_reward() -> float | None`` (optional, sync or async) is called once when the rollout has finished: one
  more reward source, weight 1, logged as ``rewards/<ClassName>/mean``.

Every other public method (no leading underscore) is a tool of that rollout. ``reset``, ``get_reward`` and the
factory itself run on the tool thread pool (async ones are awaited), timed as ``env/reset_s`` / ``env/reward_s``.

Instances are pooled per environment name: a rollout takes a free one (or creates one) and gives it back when it
ends, so an expensive ``__init__`` is paid once per concurrent rollout, not once per rollout. An instance whose
``reset``, tool loop or ``get_reward`` raised is discarded instead. Only the rollout process's event loop thread
touches the pool.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from asyncgrpo_cli import registry
from asyncgrpo_cli.errors import UserError, require_picklable
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.agent.tools import Tool, check_unique, tool_from_callable
from asyncgrpo_cli.samples import Rollout

ROUTE_COLUMN = "environment"
"""The dataset column naming each row's environment when ``environment_factory`` is a mapping."""
RESERVED = frozenset({"reset", "get_reward"})
CONFIG_KEY = "rollout.environment_factory"


@dataclass
class EnvironmentKind:
    """One configured factory."""

    name: str
    """Its routing name (the mapping's key); the class name for a single factory."""
    factory: Callable[[], Any]
    key: str
    """The config key it came from, for messages (``rollout.environment_factory.game``)."""

    @property
    def class_name(self) -> str:
        """The factory's name (the class name for a class; an environment's reward is logged under its own
        class's name, ``type(env).__name__``)."""
        return getattr(self.factory, "__name__", type(self.factory).__name__)

    @property
    def has_reward(self) -> bool | None:
        """Whether its environments define ``get_reward``; None when the factory is a function (known only once
        it has built one)."""
        if not inspect.isclass(self.factory):
            return None
        return callable(getattr(self.factory, "get_reward", None))


@dataclass
class Environments:
    """The configured factories; ``routed`` when rows pick theirs by the ``environment`` column."""

    kinds: dict[str, EnvironmentKind] = field(default_factory=dict)
    routed: bool = False

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def kind_for(self, row: Mapping[str, Any]) -> EnvironmentKind:
        if not self.routed:
            return next(iter(self.kinds.values()))
        name = row.get(ROUTE_COLUMN)
        if name not in self.kinds:
            raise UserError(
                f"a dataset row's {ROUTE_COLUMN!r} is {name!r}, not one of {CONFIG_KEY}'s names "
                f"({', '.join(sorted(self.kinds))}); fix the column or add the environment."
            )
        return self.kinds[name]

    def check_rows(self, column_names: list[str], values: Callable[[], list[Any]]) -> None:
        """Startup check of the dataset against routing (``values`` reads the ``environment`` column)."""
        if not self.routed:
            return
        if ROUTE_COLUMN not in column_names:
            raise UserError(
                f"{CONFIG_KEY} maps several environments, so every dataset row needs an {ROUTE_COLUMN!r} column "
                f"naming one of {', '.join(sorted(self.kinds))} (the dataset has {', '.join(column_names)}); "
                "e.g. +data.columns.environment=NAME, and one per data.mix part."
            )
        unknown = sorted({str(v) for v in values()} - set(self.kinds))
        if unknown:
            raise UserError(
                f"the dataset's {ROUTE_COLUMN!r} column names {', '.join(unknown)}, which {CONFIG_KEY} does not "
                f"define (it defines {', '.join(sorted(self.kinds))})."
            )


def _resolve(entry: Any, key: str) -> Callable[[], Any]:
    if not isinstance(entry, str):
        raise UserError(f"{key} must be a registered name or module:Class, got {entry!r}.")
    factory = registry.resolve("environment", entry)
    if not callable(factory):
        raise UserError(f"{key} ({entry}) is not callable: give a class or a factory function.")
    if inspect.isclass(factory) and not callable(getattr(factory, "reset", None)):
        raise UserError(f"{key} ({entry}) has no reset method: an environment needs reset(**row_columns).")
    require_picklable(
        factory,
        f"{key} ({entry})",
        "environments are built in the rollout process: define the class (or factory function) at module level, "
        "not in a function or as a lambda.",
    )
    return factory


def load_environments(value: Any) -> Environments:
    """``rollout.environment_factory`` resolved (None -> no environments)."""
    if not value:
        return Environments()
    if isinstance(value, Mapping):
        kinds = {
            str(name): EnvironmentKind(
                str(name), _resolve(entry, f"{CONFIG_KEY}.{name}"), f"{CONFIG_KEY}.{name}"
            )
            for name, entry in value.items()
        }
        return Environments(kinds, routed=True)
    factory = _resolve(value, CONFIG_KEY)
    kind = EnvironmentKind(getattr(factory, "__name__", str(value)), factory, CONFIG_KEY)
    return Environments({kind.name: kind}, routed=False)


async def call_hook(fn: Callable[..., Any], executor: Executor | None, **kwargs: Any) -> Any:
    """Call a sync hook on ``executor`` or await an async one."""
    if inspect.iscoroutinefunction(fn):
        return await fn(**kwargs)
    result = await asyncio.get_running_loop().run_in_executor(executor, partial(fn, **kwargs))
    if inspect.isawaitable(result):  # a sync wrapper returning a coroutine
        result = await result
    return result


def reset_kwargs(reset: Callable[..., Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's columns ``reset`` accepts (all of them with ``**kwargs``), never ``environment``."""
    columns = {k: v for k, v in row.items() if k != ROUTE_COLUMN}
    params = inspect.signature(reset).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return columns
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in columns.items() if k in names}


def with_task(prompt: list[dict[str, Any]], task: str | None, kind: EnvironmentKind) -> list[dict[str, Any]]:
    """The rollout's prompt: ``task`` (what ``reset`` returned) appended to the last user message, or the user
    message itself when the prompt has none."""
    messages = [dict(m) for m in prompt]
    if task is None:
        if not any(m.get("role") == "user" for m in messages):
            raise RuntimeError(
                f"{kind.class_name}.reset ({kind.key}) returned None and the row has no prompt: with "
                "data.source=environment, reset must return the task as a string."
            )
        return messages
    if not isinstance(task, str):
        raise RuntimeError(
            f"{kind.class_name}.reset ({kind.key}) returned {type(task).__name__}; expected str or None."
        )
    for m in reversed(messages):
        if m.get("role") == "user":
            m["content"] = f"{m['content']}\n\n{task}" if m.get("content") else task
            return messages
    messages.append({"role": "user", "content": task})
    return messages


class EnvironmentPool:
    """Free instances per environment name; methods run on the event loop thread only."""

    def __init__(self, environments: Environments, executor: Executor | None):
        self.environments = environments
        self.executor = executor
        self._free: dict[str, list[Any]] = {name: [] for name in environments.kinds}
        self._schemas: dict[tuple[type, str], dict[str, Any]] = {}
        self.created = 0

    async def acquire(self, kind: EnvironmentKind) -> Any:
        free = self._free[kind.name]
        if free:
            return free.pop()
        self.created += 1
        return await call_hook(kind.factory, self.executor)

    def release(self, kind: EnvironmentKind, env: Any) -> None:
        self._free[kind.name].append(env)

    def tools(self, env: Any, kind: EnvironmentKind) -> list[Tool]:
        """The instance's public methods as tools (schemas built once per class and method)."""
        out = []
        for name in sorted(dir(type(env))):
            if name.startswith("_") or name in RESERVED:
                continue
            if not callable(getattr(type(env), name, None)) or isinstance(
                inspect.getattr_static(type(env), name), property
            ):
                continue
            method = getattr(env, name)
            key = f"{kind.key} ({type(env).__name__}.{name})"
            schema = self._schemas.get((type(env), name))
            if schema is None:
                tool = tool_from_callable(method, key)
                self._schemas[(type(env), name)] = tool.schema
            else:
                tool = Tool(name, method, inspect.iscoroutinefunction(method), schema, key)
            out.append(tool)
        return out


async def run_in_environment(
    pool: EnvironmentPool,
    kind: EnvironmentKind,
    row: Mapping[str, Any],
    prompt: list[dict[str, Any]],
    base_tools: list[Tool],
    generate: Callable[[list[dict[str, Any]], list[Tool]], Awaitable[Rollout]],
    metrics: MetricWindow,
) -> Rollout:
    """One rollout in an environment instance: reset, ``generate`` (the tool loop) with the trainer's tools plus
    the instance's, then ``get_reward``; the instance goes back to the pool unless something raised."""
    env = await pool.acquire(kind)
    name = type(env).__name__
    t0 = time.monotonic()
    try:
        task = await call_hook(env.reset, pool.executor, **reset_kwargs(env.reset, row))
    except Exception as e:
        raise RuntimeError(f"{name}.reset ({kind.key}) raised {type(e).__name__}: {e}") from e
    metrics.add("env/reset_s", time.monotonic() - t0)
    messages = with_task(prompt, task, kind)
    tools = [*base_tools, *pool.tools(env, kind)]
    check_unique(tools)
    rollout = await generate(messages, tools)
    rollout.prompt = messages
    get_reward = getattr(env, "get_reward", None)
    if callable(get_reward):
        t0 = time.monotonic()
        try:
            value = await call_hook(get_reward, pool.executor)
        except Exception as e:
            raise RuntimeError(f"{name}.get_reward ({kind.key}) raised {type(e).__name__}: {e}") from e
        metrics.add("env/reward_s", time.monotonic() - t0)
        rollout.env_reward = (name, None if value is None else float(value))
    pool.release(kind, env)
    return rollout
