"""User-facing errors: one paragraph naming the config key (or flag) and the fix, never a deep traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix (config key, dataset column, server URL, ...).

    The CLI prints the message alone, without a traceback, and exits with status 2.
    """


class ConfigError(UserError):
    """One or more invalid config values; ``errors`` lists each problem on its own line."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid configuration ({len(self.errors)} problem(s)):\n{lines}")


class RolloutWorkerError(RuntimeError):
    """The rollout process failed or stopped answering; the message carries its traceback."""
