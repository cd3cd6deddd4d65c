"""The served model: loading it, its EOS ids and sampling defaults, and reloading its weights from safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def load_model(
    model_dir: str | Path, dtype: str = "float32", device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """Load a causal LM for serving on ``device`` (SDPA attention, eval mode, no grad)."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.model.loading import NO_HUB_KERNELS

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=resolve_dtype(dtype), attn_implementation="sdpa", **NO_HUB_KERNELS
    ).to(device)
    model.eval()
    model.requires_grad_(False)
    check_layer_types(model, model_dir)
    return model


SERVED_LAYER_TYPES = ("full_attention", "linear_attention")


def check_layer_types(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Serve full-attention layers and gated-DeltaNet linear-attention layers (hybrids such as Qwen3.5, with at
    least one attention layer); refuse other layer types (sliding windows, Mamba, ...), and hybrids on a
    transformers whose ``DynamicCache`` does not keep their state in ``LinearAttentionLayer`` s (``kvcache.py``
    batches those states)."""
    from transformers.cache_utils import DynamicCache

    from asyncgrpo_cli.embedded.kvcache import LinearAttentionLayer, linear_layers

    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
    other = sorted(set(layer_types) - set(SERVED_LAYER_TYPES))
    if other or (layer_types and "full_attention" not in layer_types):
        raise ValueError(
            f"the embedded server serves decoder models of full-attention layers, or hybrids of full-attention and "
            f"linear-attention (gated DeltaNet) layers; {model_dir} has layer types {sorted(set(layer_types))}. "
            "Use a vLLM server (server=vllm or server=vllm_launch)."
        )
    linear = linear_layers(model)
    if not linear:
        return
    layers = DynamicCache(config=model.config).layers if LinearAttentionLayer is not None else []
    if not all(i < len(layers) and isinstance(layers[i], LinearAttentionLayer) for i in linear):
        import transformers

        raise ValueError(
            f"serving the hybrid model {model_dir} needs a transformers whose DynamicCache keeps linear-attention "
            f"states in cache_utils.LinearAttentionLayer (5.17 and 5.24 do); this is transformers "
            f"{transformers.__version__}. Upgrade transformers, or use a vLLM server "
            "(server=vllm or server=vllm_launch)."
        )


def eos_token_ids(model: torch.nn.Module, tokenizer: Any, model_dir: str | Path) -> set[int]:
    """EOS ids that stop a sequence: the tokenizer's EOS plus generation_config's (an int or a list), or the
    model config's when there is no generation_config.json."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value if v is not None)

    add(getattr(tokenizer, "eos_token_id", None))
    gen = getattr(model, "generation_config", None)
    if (Path(model_dir) / "generation_config.json").is_file() and gen is not None:
        add(gen.eos_token_id)
    else:
        add(getattr(model.config, "eos_token_id", None))
    return ids


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """Sampling values set in generation_config.json: vLLM's defaults for fields a request leaves null."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {k: data[k] for k in SAMPLING_KEYS if data.get(k) is not None}


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Parameter and persistent-buffer names grouped by the tensor they share (tied embeddings share one)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _checkpoint_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                shapes[key] = (tuple(f.get_slice(key).get_shape()), path)
    return shapes


def check_checkpoint(model: torch.nn.Module, weights_dir: Path) -> list[Path]:
    """Validate names and shapes of every ``*.safetensors`` in ``weights_dir`` against the model, loading nothing.

    A checkpoint may omit the alias of a tied tensor (``lm_head.weight`` of a tied-embedding model); any other
    missing name, an unknown name or a shape mismatch is an error naming the tensors.
    """
    files = sorted(weights_dir.glob("*.safetensors"))
    if not weights_dir.is_dir() or not files:
        raise ValueError(f"reload_weights: no *.safetensors files in {weights_dir}")
    shapes = _checkpoint_shapes(files)
    state = model.state_dict(keep_vars=True)
    unknown = sorted(k for k in shapes if k not in state)
    missing = [g[0] for g in _tied_groups(model) if not any(name in shapes for name in g)]
    wrong = sorted(
        f"{k} {list(s)} (model: {list(state[k].shape)})"
        for k, (s, _) in shapes.items()
        if k in state and tuple(state[k].shape) != s
    )
    problems = []
    if unknown:
        problems.append(f"unknown tensors {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    if missing:
        problems.append(f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if wrong:
        problems.append(f"shape mismatches {wrong[:8]}")
    if problems:
        raise ValueError(f"reload_weights from {weights_dir}: " + "; ".join(problems))
    return files


@torch.no_grad()
def load_weights_dir(model: torch.nn.Module, weights_dir: str | Path) -> int:
    """Copy every tensor of the checkpoint into the model in place; return how many tensors were loaded.

    Everything is validated before the first copy, so a bad checkpoint leaves the model untouched.
    """
    from safetensors.torch import load_file

    files = check_checkpoint(model, Path(weights_dir))
    state = model.state_dict(keep_vars=True)
    count = 0
    for path in files:
        for name, tensor in load_file(str(path)).items():
            state[name].data.copy_(tensor)
            count += 1
    return count
