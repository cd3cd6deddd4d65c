"""User-facing errors: one paragraph naming the config key (or flag) and the fix, never a deep traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix (config key, dataset column, server URL, ...).

    The CLI prints the message alone, without a traceback, and exits with status 2 (any other failure of a run:
    status 1, one line, the traceback in the run directory's ``error.log``).
    """


class ConfigError(UserError):
    """One or more invalid config values; ``errors`` lists each problem on its own line."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid configuration ({len(self.errors)} problem(s)):\n{lines}")


class RunFailure(RuntimeError):
    """A run failed for a reason its message states in full: the CLI prints the message alone (no type name)."""


class RolloutWorkerError(RunFailure):
    """The rollout process failed or stopped answering. The message is the failure in a line or two (a reward
    error names the function and the row); ``remote_traceback`` holds the process's traceback (``error.log``)."""

    def __init__(self, message: str, remote_traceback: str = ""):
        super().__init__(message)
        self.remote_traceback = remote_traceback


class ServerExitedError(RunFailure):
    """A server the run started (embedded, vllm_launch) exited while the run needed it; names pid, status, log."""


def require_picklable(obj: object, what: str, fix: str) -> None:
    """Raise a ``UserError`` ``"{what} cannot be pickled (<why>); {fix}"`` unless ``obj`` pickles: everything
    the spawned rollout process receives (reward functions, environment factories) crosses by pickling."""
    import pickle

    try:
        pickle.dumps(obj)
    except Exception as e:
        raise UserError(f"{what} cannot be pickled ({e}); {fix}") from e
