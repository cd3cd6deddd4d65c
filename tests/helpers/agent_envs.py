"""Environments for the agent tests, importable as ``tests.helpers.agent_envs:NAME`` (module level, so they pickle
into the spawned rollout process), plus the broken ones ``load_environments`` must refuse (no ``reset``, a lambda
factory, a class defined inside a function).

``CodingEnv`` and ``GameEnv`` are the two environments of the routing tests: each has one tool (``run_code`` /
``move``) the other must never see. Nothing here runs code for real.
"""

from __future__ import annotations

import asyncio
import threading


class CodingEnv:
    """Write code that prints a target number; rewarded 1.0 once a snippet holding it ran."""

    def __init__(self) -> None:
        self.target = 42
        self.ran: list[str] = []

    def reset(self, target: int | None = None) -> str:
        self.target = 42 if target is None else int(target)
        self.ran = []
        return f"Write code that prints {self.target}."

    def run_code(self, code: str) -> str:
        """Run a snippet of Python code (pretend) and return what it printed.

        Args:
            code: The Python source to run.
        """
        self.ran.append(code)
        return str(self.target) if str(self.target) in code else ""

    def get_reward(self) -> float:
        return float(any(str(self.target) in code for code in self.ran))


class GameEnv:
    """Reach tile 2 from tile 0 with ``move``; rewarded 1.0 on it."""

    def __init__(self) -> None:
        self.position = 0

    def reset(self, start: int = 0) -> str:
        self.position = int(start)
        return "Reach tile 2 by calling move."

    def move(self, action: str) -> str:
        """Move one tile.

        Args:
            action: The direction, left or right.
        """
        self.position += 1 if action == "right" else -1
        return str(self.position)

    def get_reward(self) -> float:
        return float(self.position == 2)


class AsyncRewardEnv:
    """``reset`` and ``get_reward`` are coroutines; the reward is the number of ``ping`` calls."""

    def __init__(self) -> None:
        self.pings = 0

    async def reset(self) -> str:
        await asyncio.sleep(0)
        self.pings = 0
        return "Ping as often as you like."

    def ping(self) -> str:
        """Answer pong."""
        self.pings += 1
        return "pong"

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return float(self.pings)


class NoRewardEnv:
    """``get_reward`` returns None: it scores nothing."""

    def reset(self) -> None:
        return None

    def get_reward(self) -> None:
        return None


class TaskColumnEnv:
    """``reset`` takes only the row's ``task`` column, and remembers the thread it ran on."""

    def __init__(self) -> None:
        self.reset_thread = ""
        self.resets = 0
        self.notes: list[str] = []

    def reset(self, task: str) -> str:
        self.reset_thread = threading.current_thread().name
        self.resets += 1
        self.notes = []
        return task

    def note(self, text: str) -> str:
        """Write down a note.

        Args:
            text: What to note.
        """
        self.notes.append(text)
        return "noted"


class RaisingResetEnv:
    """Its ``reset`` raises."""

    def reset(self) -> str:
        raise ValueError("no level loaded")


class RaisingRewardEnv:
    """Its ``get_reward`` raises."""

    def reset(self) -> str:
        return "Do anything."

    def get_reward(self) -> float:
        raise ZeroDivisionError("score over zero moves")


class FlakyResetEnv:
    """``reset`` raises on an instance's first use only (to show a failed instance is never reused)."""

    def __init__(self) -> None:
        self.used = False

    def reset(self) -> str:
        if not self.used:
            self.used = True
            raise RuntimeError("cold start")
        return "Warm."


class ManyMembersEnv:
    """Members of every kind: only ``look`` and ``async_look`` are tools."""

    label = "a class attribute, not callable"

    def __init__(self) -> None:
        self._secret = 1

    def reset(self) -> str:
        return "Look around."

    def get_reward(self) -> float:
        return 0.0

    def look(self, direction: str) -> str:
        """Look in a direction.

        Args:
            direction: Where to look.
        """
        return f"a wall to the {direction}"

    async def async_look(self, direction: str) -> str:
        """Look in a direction, asynchronously.

        Args:
            direction: Where to look.
        """
        await asyncio.sleep(0)
        return f"a door to the {direction}"

    @property
    def score(self) -> int:
        return self._secret

    def _helper(self) -> str:
        return "private"


class NoResetEnv:
    """Has tools but no ``reset``: not an environment."""

    def step(self, action: str) -> str:
        """Act.

        Args:
            action: What to do.
        """
        return action


def make_game() -> GameEnv:
    """A factory function (not a class): a valid ``environment_factory``."""
    return GameEnv()


lambda_factory = lambda: GameEnv()  # noqa: E731  (deliberately a lambda: load_environments must refuse it)


def _make_local_class() -> type:
    class LocalEnv:
        def reset(self) -> str:
            return "local"

    return LocalEnv


LocalEnv = _make_local_class()
"""A class defined inside a function: pickling it by reference fails."""
