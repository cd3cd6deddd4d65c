"""The config side of LoRA weight sync, on plain data: the limits vLLM accepts, the retention rule, what makes an
adapter unservable, and the checks, derived defaults and plan line of ``model.lora`` with ``server.weight_sync``.

``config/`` imports no torch and nothing from ``sync/``: the weight-sync backend's own rules (names, the
adapter-or-merged decision against a server) are ``sync/lora_policy.py``, which builds on these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.errors import UserError

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM accepts."""
NAME_TEMPLATE = "policy-v{version}"
UNTARGETABLE = ("lm_head", "embed_tokens")
"""The chunked LM head reads the base embedding / head weight, so an adapter there would not be trained."""
MERGES_LORA = ("disk", "lora")
"""Weight-sync backends that can push a LoRA model (``disk`` writes merged weights through ``write_full_state``)."""


def kept_versions(max_staleness: int) -> int:
    return max_staleness + 2


def served_rank(r: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that serves rank ``r``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise UserError(f"model.lora.r ({r}) is above vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]}).")


@dataclass(frozen=True)
class AdapterSpec:
    """What the trainer's adapter is, as far as serving it is concerned."""

    rank: int
    targets: frozenset[str]
    """Suffixes of the adapted modules (``q_proj``, ...)."""
    use_dora: bool = False
    bias: str = "none"
    modules_to_save: tuple[str, ...] = ()


def int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def unservable_reasons(spec: AdapterSpec) -> list[str]:
    """What makes the adapter itself unservable by any server (config-level: no server needed)."""
    out = []
    if spec.use_dora:
        out.append("model.lora.use_dora=true (servers cannot apply DoRA)")
    if spec.modules_to_save:
        out.append(f"model.lora.modules_to_save={list(spec.modules_to_save)} (fully trained modules)")
    if spec.bias != "none":
        out.append(f"model.lora.bias={spec.bias} (trained biases)")
    bad = sorted(t for t in spec.targets if t in UNTARGETABLE)
    if bad:
        out.append(f"adapters on {bad}")
    return out


def config_spec(cfg: Any) -> AdapterSpec:
    """The adapter as configured (``model.lora``); ``all-linear`` counts as the usual projections."""
    lora = cfg.model.lora
    targets = frozenset(lora.target_modules) - {"all-linear"}
    return AdapterSpec(
        rank=lora.r,
        targets=targets,
        use_dora=lora.use_dora,
        bias=lora.bias,
        modules_to_save=tuple(lora.modules_to_save),
    )


# -- config -------------------------------------------------------------------------------------------------------
def derive_defaults(cfg: Any) -> None:
    """Fill what adapter sync needs and was left at None: ``server.embedded.enable_lora``,
    ``server.vllm_launch.max_lora_rank`` and ``max_loras``."""
    launch = cfg.server.vllm_launch
    if cfg.server.weight_sync != "lora" or not cfg.model.lora.enabled:
        return
    if cfg.server.embedded.enable_lora is None:
        cfg.server.embedded = dataclasses.replace(cfg.server.embedded, enable_lora=True)
    updates: dict[str, int] = {}
    if launch.max_lora_rank is None and cfg.model.lora.r <= VLLM_LORA_RANKS[-1]:
        updates["max_lora_rank"] = served_rank(cfg.model.lora.r)
    if launch.max_loras is None:
        updates["max_loras"] = kept_versions(cfg.rollout.max_staleness)
    if updates:
        cfg.server.vllm_launch = dataclasses.replace(launch, **updates)


def _api_server_count(extra_args: list[str]) -> int | None:
    for i, arg in enumerate(extra_args):
        for flag in ("--api-server-count", "-asc"):
            if arg == flag and i + 1 < len(extra_args):
                return int_or_none(extra_args[i + 1])
            if arg.startswith(flag + "="):
                return int_or_none(arg.split("=", 1)[1])
    return None


def config_errors(cfg: Any) -> list[str]:
    """Every problem of ``model.lora`` and its combination with ``server.weight_sync``, each naming the keys."""
    lora, sv = cfg.model.lora, cfg.server
    errs: list[str] = []
    if sv.weight_sync == "lora" and not lora.enabled:
        errs.append(
            "server.weight_sync=lora syncs a LoRA adapter, but model.lora.enabled is false: set "
            "model.lora.enabled=true, or server.weight_sync=disk to sync full weights."
        )
    if not lora.enabled:
        return errs
    if sv.weight_sync not in MERGES_LORA:
        errs.append(
            f"server.weight_sync={sv.weight_sync} sends the model's tensors as they are, but with model.lora.enabled "
            "they are the base weights plus separate adapter tensors: use server.weight_sync=lora (the adapter) "
            "or disk (merged full weights)."
        )
    if lora.r < 1:
        errs.append(f"model.lora.r ({lora.r}) must be >= 1.")
    elif lora.r > VLLM_LORA_RANKS[-1]:
        errs.append(
            f"model.lora.r ({lora.r}) is above vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]})."
        )
    if lora.alpha <= 0:
        errs.append(f"model.lora.alpha ({lora.alpha}) must be > 0.")
    if not 0 <= lora.dropout < 1:
        errs.append(f"model.lora.dropout ({lora.dropout}) must be in [0, 1).")
    if not lora.target_modules:
        errs.append(
            "model.lora.target_modules is empty: name the modules to adapt, e.g. [q_proj, v_proj] or "
            "[all-linear]."
        )
    for key in ("target_modules", "modules_to_save"):
        bad = [t for t in getattr(lora, key) if t in UNTARGETABLE]
        if bad:
            errs.append(
                f"model.lora.{key} names {bad}: the chunked LM head reads the base weight, so it would "
                "never be trained; remove it."
            )
    if sv.weight_sync == "lora" and sv.backend == "vllm_launch":
        errs += _launch_errors(cfg)
    if sv.weight_sync == "lora" and sv.backend == "embedded" and sv.embedded.enable_lora is False:
        errs.append(
            "server.embedded.enable_lora=false, but server.weight_sync=lora loads adapters on the embedded "
            "server: set it to true (or leave it null)."
        )
    return errs


def _launch_errors(cfg: Any) -> list[str]:
    launch, errs = cfg.server.vllm_launch, []
    rank = launch.max_lora_rank
    if rank is not None and rank not in VLLM_LORA_RANKS:
        errs.append(
            f"server.vllm_launch.max_lora_rank ({rank}) must be one of "
            f"{', '.join(map(str, VLLM_LORA_RANKS))} (vLLM's --max-lora-rank)."
        )
    elif rank is not None and rank < cfg.model.lora.r:
        errs.append(
            f"server.vllm_launch.max_lora_rank ({rank}) is below model.lora.r ({cfg.model.lora.r}): "
            f"raise it to {served_rank(cfg.model.lora.r)} or leave it null."
        )
    need = kept_versions(cfg.rollout.max_staleness)
    if launch.max_loras is not None and launch.max_loras < need:
        errs.append(
            f"server.vllm_launch.max_loras ({launch.max_loras}) is below rollout.max_staleness + 2 "
            f"({need}), the adapter versions kept loaded: raise it or leave it null."
        )
    count = _api_server_count([str(a) for a in launch.extra_args])
    if count is not None and count > 1:
        errs.append(
            f"server.vllm_launch.extra_args sets --api-server-count {count}: vLLM refuses runtime LoRA "
            "loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING) with more than one API server; drop it for "
            "server.weight_sync=lora."
        )
    return errs


def plan_line(cfg: Any) -> str | None:
    """What ``asyncgrpo check`` says about LoRA weight sync; None when LoRA is off."""
    if not cfg.model.lora.enabled:
        return None
    lora = cfg.model.lora
    what = f"LoRA r={lora.r} alpha={lora.alpha:g} on {', '.join(lora.target_modules)}"
    if cfg.server.weight_sync != "lora":
        return f"{what}: merged full weights are pushed (server.weight_sync={cfg.server.weight_sync})"
    keep = kept_versions(cfg.rollout.max_staleness)
    reasons = unservable_reasons(config_spec(cfg))
    if reasons:
        return f"{what}: not servable as an adapter ({'; '.join(reasons)}), so merged full weights are pushed"
    return (
        f"{what}: the adapter is loaded as {NAME_TEMPLATE.format(version='N')} per version, {keep} kept; "
        "merged full weights if the server cannot serve it"
    )
