"""``disk`` weight sync: write safetensors to a directory the server can read, then pause, ``reload_weights``,
reset the prefix cache, set the weight version and resume.

Works on CPU, with vLLM (``collective_rpc reload_weights`` under ``VLLM_SERVER_DEV_MODE=1``) and the embedded
server, and across hosts with a shared filesystem. Each version is written to its own directory (atomically:
temp dir + rename); the two newest are kept, because a server resolves the path lazily.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from asyncgrpo_cli.server.control import ServerControl

KEEP_VERSIONS = 2


def state_dict_for_sync(model: Any) -> dict[str, Any]:
    """The model's HF-named tensors, contiguous, on CPU, without tied duplicates (safetensors refuses aliases)."""
    import torch

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue
        seen[ptr] = name
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


class DiskWeightSync:
    def __init__(self, control: ServerControl, directory: Path):
        self.control = control
        self.directory = Path(directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)

    def push(self, model: Any, version: int) -> dict[str, float]:
        """Send the model's weights as ``version``; returns the phase timings in seconds."""
        from safetensors.torch import save_file

        t0 = time.monotonic()
        final = self.directory / f"v{version:06d}"
        tmp = self.directory / f".v{version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(state_dict_for_sync(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        t_write = time.monotonic()
        self.control.pause(mode="keep")
        t_pause = time.monotonic()
        try:
            self.control.collective_rpc("reload_weights", {"weights_path": str(final)})
            self.control.reset_prefix_cache()
            self.control.update_weight_version(f"v{version}")
        finally:
            self.control.resume()
        t_done = time.monotonic()
        self._cleanup(keep=final)
        return {
            "perf/weight_sync_s": t_done - t0,
            "perf/weight_sync_pause_s": t_pause - t_write,
            "perf/weight_sync_barrier_s": 0.0,
            "perf/weight_sync_transfer_s": (t_write - t0) + (t_done - t_pause),
        }

    def _cleanup(self, keep: Path) -> None:
        versions = sorted(p for p in self.directory.glob("v*") if p.is_dir())
        for old in versions[:-KEEP_VERSIONS]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Remove the serving copies: checkpoints, not this directory, are what a run keeps."""
        for version in self.directory.glob("v*"):
            shutil.rmtree(version, ignore_errors=True)
        for tmp in self.directory.glob(".v*.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)
