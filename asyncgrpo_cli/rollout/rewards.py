"""Reward functions in the rollout process: resolving ``rewards.funcs`` entries, and calling them on a group.

``call_reward_funcs`` returns one row per function and one column per completion, NaN where a function returned
``None`` (it did not score that completion). How the rows become rewards and advantages is the scorer's rule
(``rollout/scorers/``).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from asyncgrpo_cli import registry
from asyncgrpo_cli.errors import UserError, require_picklable


class RewardError(RuntimeError):
    """A reward function raised or returned something unusable; the message names the function and the row."""


@dataclass
class RewardFunction:
    name: str
    fn: Any
    is_async: bool


def _func_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def load_reward_funcs(entries: list[Any]) -> list[RewardFunction]:
    """Resolve ``rewards.funcs`` entries (names, import paths, or {name, **options}) into callables.

    Everything must be picklable: reward functions run in the spawned rollout process.
    """
    funcs: list[RewardFunction] = []
    for i, entry in enumerate(entries):
        options: dict[str, Any] = {}
        if isinstance(entry, dict):
            entry = dict(entry)
            name = entry.pop("name")
            options = entry
        else:
            name = entry
        obj = registry.resolve("reward", name)
        if options or inspect.isclass(obj):
            try:
                obj = obj(**options)
            except TypeError as e:
                raise UserError(f"rewards.funcs[{i}] ({name}): bad options {options}: {e}") from e
        if not callable(obj):
            raise UserError(f"rewards.funcs[{i}] ({name}) is not callable.")
        require_picklable(
            obj,
            f"rewards.funcs[{i}] ({name})",
            "reward functions run in a separate process: use a module-level function, functools.partial, or a "
            "callable class instance (not a lambda or a closure).",
        )
        call = obj.__call__ if not inspect.isfunction(obj) and not inspect.ismethod(obj) else obj
        is_async = inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(call)
        display = name if ":" not in name else _func_name(obj)
        funcs.append(RewardFunction(display, obj, is_async))
    return funcs


def _to_float(value: Any, name: str, row_index: int, j: int) -> float:
    if value is None:
        return math.nan
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise RewardError(
            f"reward function {name!r} returned {value!r} for completion {j} of dataset row {row_index}: "
            "expected a float or None."
        ) from None
    return out


async def call_reward_funcs(
    funcs: list[RewardFunction], kwargs: dict[str, Any], n: int, row_index: int, executor: Executor | None
) -> np.ndarray:
    """Run every reward function concurrently (async ones awaited together, sync ones on threads).

    Returns a [num_funcs, n] array with NaN where a function returned None.
    """
    loop = asyncio.get_running_loop()

    async def one(rf: RewardFunction) -> list[Any]:
        try:
            if rf.is_async:
                return await rf.fn(**kwargs)
            return await loop.run_in_executor(executor, partial(rf.fn, **kwargs))
        except Exception as e:
            raise RewardError(
                f"reward function {rf.name!r} raised {type(e).__name__}: {e} (dataset row {row_index})"
            ) from e

    results = await asyncio.gather(*(one(rf) for rf in funcs))
    out = np.full((len(funcs), n), np.nan, dtype=np.float64)
    for i, (rf, res) in enumerate(zip(funcs, results)):
        if not isinstance(res, (list, tuple, np.ndarray)) or len(res) != n:
            got = f"{len(res)} values" if hasattr(res, "__len__") else repr(res)
            raise RewardError(
                f"reward function {rf.name!r} returned {got} for dataset row {row_index}; expected a list of "
                f"{n} floats (one per completion)."
            )
        out[i] = [_to_float(v, rf.name, row_index, j) for j, v in enumerate(res)]
    return out
