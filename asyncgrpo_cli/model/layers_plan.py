"""``asyncgrpo check``'s line on linear attention: which decoder layers are gated DeltaNet and which kernel will run.

Torch-free (``asyncgrpo check`` starts without importing torch): the model's ``config.json`` is read as JSON
where it is on disk already (a local directory, a built-in model in the cache, a hub id in the Hugging Face
cache), and the kernel follows ``model/gdn/layer.py:resolve_kernel``'s rule from ``model.linear_attention_kernel``,
``trainer.device`` and whether the ``fla`` package is installed (``importlib.util.find_spec``: found, not
imported; importing it would import torch). Where no config is on disk (a built-in not built yet, a hub id not
downloaded) the line says when it is decided. Models without linear-attention layers get no line.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from asyncgrpo_cli.model.loading import linear_attention_layers
from asyncgrpo_cli.registry import builtin_name, is_builtin

_INTERVAL_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
"""Families whose config derives ``layer_types`` from ``full_attention_interval`` when the file lists none."""


def config_path(name_or_path: str, revision: str | None = None) -> tuple[Path | None, str]:
    """(the model's config.json on disk or None, why it is not there)."""
    if is_builtin(name_or_path):
        from asyncgrpo_cli.model.resolve import builtin_dir

        path = builtin_dir(builtin_name(name_or_path)) / "config.json"
        return (path, "") if path.is_file() else (None, f"{name_or_path} is built on first use")
    if os.path.isdir(name_or_path):
        path = Path(name_or_path) / "config.json"
        return (path, "") if path.is_file() else (None, f"{name_or_path} has no config.json")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - not a valid repo id, an unreadable cache: nothing local to read
        cached = None
    if isinstance(cached, str):
        return Path(cached), ""
    return None, f"{name_or_path} has no local copy"


def layer_types(config: dict[str, Any]) -> list[str]:
    """The decoder's ``layer_types`` from a config.json (its ``text_config`` for multimodal wrappers)."""
    text = config.get("text_config") or config
    listed = text.get("layer_types") or config.get("layer_types")
    if listed:
        return [str(t) for t in listed]
    if text.get("model_type") in _INTERVAL_FAMILIES and text.get("num_hidden_layers"):
        interval = int(text.get("full_attention_interval") or 4)  # transformers' rule for these families
        n = int(text["num_hidden_layers"])
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    return []


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 4, 5, 6, 8] -> '0-2, 4-6, 8'."""
    out: list[str] = []
    for i in indices:
        if out and int(out[-1].rsplit("-", 1)[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def planned_kernel(kernel: str, device: str, fla_installed: bool) -> str:
    """Which gated-DeltaNet kernel ``load_policy`` will run (``resolve_kernel``'s rule, without torch)."""
    why = f"model.linear_attention_kernel={kernel}, trainer.device={device}"
    fla = "fla-core installed" if fla_installed else "fla-core not installed"
    if kernel == "torch":
        return f"torch (pure-torch chunked; {why})"
    if kernel == "fla":
        if device == "cpu":
            return f"none: loading refuses it, fla needs CUDA ({why}); use auto or torch"
        if not fla_installed:
            return f"none: loading refuses it, {fla} ({why}); pip install 'asyncgrpo[gpu]' or use auto"
        where = "" if device == "cuda" else "; loading refuses it if no CUDA device is visible"
        return f"fla (Triton chunk kernels; {why}, {fla}{where})"
    if device == "cpu":
        return f"torch (pure-torch chunked; {why})"
    if not fla_installed:
        return (
            f"torch (pure-torch chunked, exact but slow on CUDA; {why}, {fla}: pip install 'asyncgrpo[gpu]' "
            "for the Triton kernels)"
        )
    if device == "cuda":
        return f"fla (Triton chunk kernels; {why}, {fla})"
    return f"fla on CUDA, torch on CPU: the device found at start decides ({why}, {fla})"


def fla_installed_here() -> bool:
    """Whether the ``fla`` package (fla-core) is installed, without importing it (a bare directory named ``fla``
    on the path is a namespace package, not fla: it has no ``__init__``, so no origin)."""
    try:
        spec = importlib.util.find_spec("fla")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def linear_attention_line(model: Any, device: str) -> tuple[str, str] | None:
    """``("linear attention", plan)`` for ``asyncgrpo check`` (``model``: the run's ModelConfig), or None for a
    model whose config on disk declares no linear-attention layer."""
    path, missing = config_path(model.name_or_path, model.revision)
    fla_installed = fla_installed_here()
    if path is None:
        return (
            "linear attention",
            f"decided at load ({missing}): gated-DeltaNet layers, if any, would run "
            + planned_kernel(model.linear_attention_kernel, device, fla_installed),
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return ("linear attention", f"decided at load ({path} is unreadable: {e})")
    types = layer_types(config)
    linear = linear_attention_layers(SimpleNamespace(layer_types=types))
    if not linear:
        return None
    full = [i for i in range(len(types)) if i not in set(linear)]
    return (
        "linear attention",
        f"gated DeltaNet in {len(linear)} of {len(types)} decoder layers ({_ranges(linear)}); full attention in "
        f"{_ranges(full) or 'none'}; packed exactly per sample / branch; kernel: "
        + planned_kernel(model.linear_attention_kernel, device, fla_installed),
    )
