"""LoRA on the trainer: inject a PEFT adapter into the policy, describe it, gather it for a sync, merge it.

The adapter is injected in place (``peft.inject_adapter_in_model``): the policy stays the transformers model it
was (same class, decoder layers, ``get_output_embeddings``), so FSDP2, the chunked LM head and checkpoints see
the usual structure; only the adapted projections become ``lora.Linear`` modules and only the adapter's
parameters require gradients.

Two ways out to a server:

- the adapter itself (``gather_adapter`` + ``write_adapter``): ``adapter_model.safetensors`` with PEFT's saved
  names (``base_model.model.<module>.lora_A.weight``) and ``adapter_config.json``, what vLLM and the embedded
  server load;
- merged full weights (``merged_items``): a streaming transform of ``(name, tensor)`` pairs in state-dict order
  that folds each adapter into its base weight (``W + scale * B @ A``; DoRA's magnitude rescaling too) and
  renames ``base_layer`` / ``modules_to_save`` tensors back to the plain model's names. ``write_full_state`` applies
  it, so disk sync and checkpoints write an ordinary HF model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo_cli.config.schema import LoraConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.sync.lora_policy import AdapterSpec

logger = logging.getLogger(__name__)

ADAPTER = "default"
"""PEFT's adapter name inside the model."""
SAVED_PREFIX = "base_model.model."
"""Key prefix of a saved PEFT adapter (what ``PeftModel.save_pretrained`` writes and vLLM parses)."""
ADAPTER_FILE = "adapter_model.safetensors"


def apply_lora(model: Any, cfg: LoraConfig) -> Any:
    """Inject the configured adapter into ``model`` (in place) and return it; only adapter weights train."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    targets: Any = "all-linear" if list(cfg.target_modules) == ["all-linear"] else list(cfg.target_modules)
    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        use_rslora=cfg.use_rslora,
        use_dora=cfg.use_dora,
        bias=cfg.bias,
        modules_to_save=list(cfg.modules_to_save) or None,
    )
    peft_cfg.base_model_name_or_path = getattr(model.config, "_name_or_path", None)
    try:
        model = inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER)
    except ValueError as e:  # no module matched target_modules
        raise UserError(f"model.lora.target_modules={list(cfg.target_modules)}: {e}") from e
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        "LoRA r=%d on %s: %d trainable parameters of %d (%.2f%%)",
        cfg.r,
        sorted(adapter_spec(model).targets),
        trainable,
        total,
        100.0 * trainable / max(total, 1),
    )
    return model


def peft_config(model: Any) -> Any | None:
    configs = getattr(model, "peft_config", None)
    return configs.get(ADAPTER) if isinstance(configs, dict) else None


def has_lora(model: Any) -> bool:
    return peft_config(model) is not None


def lora_layers(model: Any) -> dict[str, Any]:
    """Module name -> PEFT ``LoraLayer`` of every adapted module."""
    from peft.tuners.lora import LoraLayer

    return {name: mod for name, mod in model.named_modules() if isinstance(mod, LoraLayer)}


def adapter_spec(model: Any) -> AdapterSpec:
    cfg = peft_config(model)
    if cfg is None:
        raise ValueError("the model has no LoRA adapter (model.lora.enabled is false)")
    ranks = [cfg.r, *(cfg.rank_pattern or {}).values()]
    return AdapterSpec(
        rank=max(ranks),
        targets=frozenset(name.rsplit(".", 1)[-1] for name in lora_layers(model)),
        use_dora=bool(cfg.use_dora),
        bias=str(cfg.bias),
        modules_to_save=tuple(cfg.modules_to_save or ()),
    )


# -- the adapter itself -------------------------------------------------------------------------------------------
def _is_adapter_key(name: str, bias: str) -> bool:
    return "lora_" in name or ".modules_to_save." in name or (bias != "none" and name.endswith(".bias"))


def gather_adapter(model: Any, info: Any) -> dict[str, Any] | None:
    """The adapter's tensors under PEFT's saved names, on rank 0 (None elsewhere).

    Every rank must call it: under FSDP2 each adapter tensor is all-gathered in lockstep; base weights are skipped,
    so nothing but the adapter moves.
    """
    from peft.utils import get_peft_model_state_dict

    from asyncgrpo_cli.train.distributed import iter_full_state

    cfg = peft_config(model)
    skip = {name for name in model.state_dict() if not _is_adapter_key(name, str(cfg.bias))}
    full = dict(iter_full_state(model, info, skip))
    if not info.is_main:
        return None
    saved = get_peft_model_state_dict(model, state_dict=full, adapter_name=ADAPTER)
    return {SAVED_PREFIX + name: tensor.contiguous() for name, tensor in saved.items()}


def write_adapter(model: Any, tensors: dict[str, Any], out_dir: Path) -> None:
    """``adapter_model.safetensors`` + ``adapter_config.json`` into ``out_dir`` (rank 0)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ADAPTER_FILE), metadata={"format": "pt"})
    peft_config(model).save_pretrained(str(out_dir))


def save_adapter(model: Any, info: Any, out_dir: Path) -> None:
    """Gather and write the adapter (every rank calls; rank 0 writes)."""
    tensors = gather_adapter(model, info)
    if info.is_main:
        write_adapter(model, tensors, out_dir)


# -- merged weights -----------------------------------------------------------------------------------------------
@dataclass
class _Merge:
    scaling: float
    dora: bool
    fan_in_fan_out: bool
    parts: dict[str, Any]


def _merge_plan(model: Any) -> dict[str, _Merge]:
    plan = {}
    for name, layer in lora_layers(model).items():
        if ADAPTER not in layer.lora_A:
            continue
        dora = bool(getattr(layer, "use_dora", {}).get(ADAPTER, False))
        plan[name] = _Merge(
            float(layer.scaling[ADAPTER]), dora, bool(getattr(layer, "fan_in_fan_out", False)), {}
        )
    return plan


def _merged_weight(m: _Merge) -> Any:
    import torch

    base = m.parts["base_layer.weight"]
    delta = (
        m.parts[f"lora_B.{ADAPTER}.weight"].float() @ m.parts[f"lora_A.{ADAPTER}.weight"].float()
    ) * m.scaling
    if m.fan_in_fan_out:
        delta = delta.T
    weight = base.float() + delta
    if m.dora:  # peft's DoRA merge: magnitude / ||W + dW|| (row norms) times W + dW
        norm = torch.linalg.norm(weight.T if m.fan_in_fan_out else weight, dim=1)
        magnitude = m.parts[f"lora_magnitude_vector.{ADAPTER}.weight"].float()
        factor = magnitude / norm
        weight = weight * (factor.view(1, -1) if m.fan_in_fan_out else factor.view(-1, 1))
    return weight.to(base.dtype)


def merged_items(model: Any, items: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` of the plain model with every adapter merged in, from the LoRA model's pairs (state-dict
    order); pass-through when the model has no adapter. Holds at most one adapted module's tensors at a time."""
    if not has_lora(model):
        yield from items
        return
    plan = _merge_plan(model)
    need = {f"lora_A.{ADAPTER}.weight", f"lora_B.{ADAPTER}.weight", "base_layer.weight"}
    for name, tensor in items:
        if f".modules_to_save.{ADAPTER}." in name:
            yield name.replace(f".modules_to_save.{ADAPTER}.", "."), tensor
            continue
        if ".original_module." in name:
            continue
        module, part = _owner(name, plan)
        if module is None:
            yield name, tensor
            continue
        if part == "base_layer.bias":
            yield f"{module}.bias", tensor
            continue
        m = plan[module]
        m.parts[part] = tensor
        want = need | ({f"lora_magnitude_vector.{ADAPTER}.weight"} if m.dora else set())
        if want <= m.parts.keys():
            yield f"{module}.weight", _merged_weight(m)
            m.parts.clear()


def _owner(name: str, plan: dict[str, _Merge]) -> tuple[str | None, str]:
    """(adapted module, the rest of the key) for a tensor of an adapted module, else (None, "")."""
    for marker in (".base_layer.", ".lora_A.", ".lora_B.", ".lora_magnitude_vector."):
        head, sep, _ = name.partition(marker)
        if sep and head in plan:
            return head, name[len(head) + 1 :]
    return None, ""
