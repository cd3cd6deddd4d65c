"""One training per run directory: an exclusive ``flock`` on ``RUN_DIR/.lock``, holding the owner's PID.

The kernel releases a ``flock`` when its holder exits, however it exits (SIGKILL included), so a lock left by a
dead run is free again at once; the PID in the file only names the holder in the refusal.

Example::

    with run_dir_lock(run_dir):
        train(...)
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from asyncgrpo_cli.errors import UserError

LOCK_NAME = ".lock"


class RunDirBusyError(UserError):
    """Another training holds the run directory (the refused run writes nothing there, no ``error.log``)."""


@contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[Path]:
    """Hold the run directory's lock for the block; raise a UserError naming the holder's PID if it is taken."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise RunDirBusyError(
                f"the run directory {run_dir} is in use by another training (pid {holder}); wait for it to "
                "finish or stop it, or train into another directory (hydra.run.dir=DIR)."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)  # no stale PID after a clean exit
    finally:
        os.close(fd)  # releases the lock
