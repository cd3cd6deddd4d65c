"""Tools for the agent tests, importable as ``tests.helpers.agent_tools:NAME`` (module level, so they pickle),
plus the broken ones ``load_tools`` must refuse (a lambda, a closure, a nested function, missing docstring args)."""

from __future__ import annotations

import asyncio
import threading
import time

CALL_LOG: list[str] = []
"""Tags appended by ``record`` in the order the calls finished (tests clear it)."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product a * b.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first term.
        b: The second term.

    Returns:
        The sum a + b.
    """
    await asyncio.sleep(0)
    return a + b


def explode(reason: str) -> str:
    """Always raise.

    Args:
        reason: The message of the error.
    """
    raise RuntimeError(reason)


def slow_echo(text: str, seconds: float) -> str:
    """Sleep, then return the text.

    Args:
        text: What to return.
        seconds: How long to sleep first.
    """
    time.sleep(seconds)
    return text


async def async_sleep(seconds: float) -> str:
    """Sleep on the event loop.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return "slept"


def record(tag: str, seconds: float) -> str:
    """Sleep, then append the tag to CALL_LOG.

    Args:
        tag: What to append.
        seconds: How long to sleep first.
    """
    time.sleep(seconds)
    CALL_LOG.append(tag)
    return tag


def thread_name() -> str:
    """The name of the thread the tool runs on."""
    return threading.current_thread().name


def summarize(values: list[float]) -> dict:
    """Count and sum some numbers.

    Args:
        values: The numbers.
    """
    return {"n": len(values), "sum": sum(values), "label": "résumé"}


def nothing() -> None:
    """Return nothing."""
    return None


def undocumented(a: int) -> int:
    """A tool whose docstring lacks an Args section."""
    return a


def unhinted(a, b: int) -> int:
    """A tool with an argument without a type hint.

    Args:
        a: The first.
        b: The second.
    """
    return b


lambda_tool = lambda a: a  # noqa: E731  (deliberately a lambda: load_tools must refuse it)


def _make_closure(offset: int):
    def add_offset(a: int) -> int:
        """Add the captured offset.

        Args:
            a: The number.
        """
        return a + offset

    return add_offset


def _make_nested():
    def nested(a: int) -> int:
        """Return a.

        Args:
            a: The number.
        """
        return a

    return nested


closure_tool = _make_closure(1)
nested_tool = _make_nested()


class GameEnv:
    """An environment whose public method is a tool (as a bound method)."""

    def __init__(self) -> None:
        self.position = 0

    def move(self, action: str) -> str:
        """Move one tile.

        Args:
            action: The direction (choices: ["left", "right"])

        Returns:
            The new position.
        """
        self.position += 1 if action == "right" else -1
        return str(self.position)
