"""``disk`` weight sync: write safetensors to a directory the server can read, then pause, ``reload_weights``,
reset the prefix cache, set the weight version and resume.

Works on CPU, with vLLM (``collective_rpc reload_weights`` under ``VLLM_SERVER_DEV_MODE=1``; on a server started
with asyncgrpo's worker extension, its ``asyncgrpo_reload_weights``, which also refreshes a tied ``lm_head`` on CPU:
``asyncgrpo_cli/vllm_ext.py``) and the embedded server, and across hosts with a shared filesystem. Each version is
written to its own directory (atomically: temp dir + rename); the two newest are kept, because a server resolves
the path lazily.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.sync.base import BaseWeightSync
from asyncgrpo_cli.sync.writer import write_full_state
from asyncgrpo_cli.train.distributed import DistInfo, barrier

KEEP_VERSIONS = 2


class DiskWeightSync(BaseWeightSync):
    """Every rank calls ``push`` (the full tensors are gathered in lockstep); rank 0 writes and drives the server.

    ``control`` is None on the other ranks: they only take part in the gathers.
    """

    def __init__(self, control: ServerControl | None, directory: Path, info: DistInfo | None = None):
        self.control = control
        self.info = info or DistInfo()
        self.directory = Path(directory).resolve()
        self._reload_method: str | None = None
        if self.info.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)

    def push(self, model: Any, version: int) -> dict[str, float]:
        """Send the model's weights as ``version``; returns the phase timings in seconds (rank 0)."""
        t0 = time.monotonic()
        final = self.directory / f"v{version:06d}"
        tmp = self.directory / f".v{version:06d}.tmp"
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        write_full_state(model, self.info, tmp)
        t_gathered = time.monotonic()
        barrier(self.info)
        t_write = time.monotonic()
        if not self.info.is_main:
            return {}
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self.control.pause(mode="keep")
        t_pause = time.monotonic()
        try:
            self.control.collective_rpc(self.reload_method(), {"weights_path": str(final)})
            self.control.reset_prefix_cache()
            self.control.update_weight_version(f"v{version}")
        finally:
            self.control.resume()
        t_done = time.monotonic()
        self._cleanup(keep=final)
        return {
            "perf/weight_sync_s": t_done - t0,
            "perf/weight_sync_pause_s": t_pause - t_write,
            "perf/weight_sync_barrier_s": t_write - t_gathered,
            "perf/weight_sync_transfer_s": (t_gathered - t0) + (t_done - t_pause),
        }

    def reload_method(self) -> str:
        """The ``collective_rpc`` method that loads a version: the worker extension's when the server has it (asked
        once, from ``/server_info``), else vLLM's ``reload_weights``."""
        if self._reload_method is None:
            from asyncgrpo_cli.server.report import has_worker_extension
            from asyncgrpo_cli.vllm_ext import RELOAD_METHOD

            self._reload_method = RELOAD_METHOD if has_worker_extension(self.control) else "reload_weights"
        return self._reload_method

    def _cleanup(self, keep: Path) -> None:
        versions = sorted(p for p in self.directory.glob("v*") if p.is_dir())
        for old in versions[:-KEEP_VERSIONS]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Remove the serving copies: checkpoints, not this directory, are what a run keeps."""
        if not self.info.is_main:
            return
        for version in self.directory.glob("v*"):
            shutil.rmtree(version, ignore_errors=True)
        for tmp in self.directory.glob(".v*.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)
