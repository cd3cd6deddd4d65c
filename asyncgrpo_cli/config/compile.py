"""``trainer.compile`` resolved: whether the decoder layers are compiled on a device, and ``asyncgrpo check``'s line.

Torch-free (the config layer and ``asyncgrpo check`` start without importing torch); ``train/compile.py`` does the
compiling.
"""

from __future__ import annotations

from typing import Any


def compile_enabled(setting: Any, device: Any) -> bool:
    """Whether ``trainer.compile=setting`` compiles the decoder layers on ``device`` (a torch.device or a name)."""
    if setting == "auto":
        return getattr(device, "type", str(device).split(":")[0]) == "cuda"
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"trainer.compile={setting!r} must be auto, true or false")


def compile_plan(setting: Any, device: str) -> str:
    """``asyncgrpo check``'s line: what ``trainer.compile=setting`` does with ``trainer.device=device``."""
    why = f"trainer.compile={str(setting).lower()}, trainer.device={device}"
    if setting == "auto" and device == "auto":
        return f"on if the trainer finds a CUDA device at start, off on CPU ({why})"
    if not compile_enabled(setting, device):
        return f"off: the decoder layers run eagerly ({why})"
    cpu = "; on CPU inductor builds C++ kernels, slow first steps" if device == "cpu" else ""
    return f"on: torch.compile of each decoder layer, compile time logged per step as perf/compile_total_s ({why}{cpu})"
