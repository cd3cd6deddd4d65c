"""Resolve ``model.name_or_path``: built-in models are materialized into the cache once; others pass through."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from asyncgrpo_cli import registry
from asyncgrpo_cli.paths import cache_dir
from asyncgrpo_cli.registry import builtin_name, is_builtin

# Bump when a builder's output changes, so stale caches are rebuilt.
_BUILD_VERSION = "3"


def builtin_dir(name: str) -> Path:
    return cache_dir() / "models" / f"{name}-v{_BUILD_VERSION}"


def resolve_model_path(name_or_path: str) -> str:
    """Return a hub id or a local directory. Built-ins are built on first use (atomically, under a file lock)."""
    if not is_builtin(name_or_path):
        return name_or_path
    name = builtin_name(name_or_path)
    dest = builtin_dir(name)
    if (dest / "config.json").is_file():
        return str(dest)
    builder = registry.resolve("model", name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.parent / f".{dest.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "config.json").is_file():  # built by another process while we waited
            return str(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            builder(tmp)
            for path in (tmp, *tmp.rglob("*")):  # mkdtemp is private (0700): make the cache readable
                path.chmod(0o755 if path.is_dir() else 0o644)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)
