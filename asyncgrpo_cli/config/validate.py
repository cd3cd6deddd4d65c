"""Strict conversion of a composed config (plain dict / DictConfig) into the typed ``RootConfig``.

Every problem is collected and reported at once: unknown keys (with a "did you mean" hint), wrong types, and
values out of range, each naming the full key, the value and the fix. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, get_args, get_origin, get_type_hints

from asyncgrpo_cli import registry
from asyncgrpo_cli.config import lora as lora_policy
from asyncgrpo_cli.config.schema import ATTN_CHOICES, RootConfig
from asyncgrpo_cli.errors import ConfigError

_MISSING = object()


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) < len(get_args(tp)):
            return True, (args[0] if len(args) == 1 else typing.Union[tuple(args)])
    return False, tp


def _convert(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    optional, inner = _is_optional(tp)
    if value is None:
        if optional or tp is Any:
            return None
        errors.append(f"{path} is required (got null); set it to a {_type_name(inner)}.")
        return _MISSING
    tp = inner
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{path} must be a mapping of {tp.__name__} fields, got {value!r}.")
            return _MISSING
        return build_dataclass(tp, value, path, errors)
    origin = get_origin(tp)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            errors.append(f"{path} must be a list, got {value!r} (e.g. {path}=[a,b]).")
            return _MISSING
        (item_tp,) = get_args(tp) or (Any,)
        out = [_convert(v, item_tp, f"{path}[{i}]", errors) for i, v in enumerate(value)]
        return out
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path} must be a mapping, got {value!r}.")
            return _MISSING
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        errors.append(f"{path} must be true or false, got {value!r}.")
        return _MISSING
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        errors.append(f"{path} must be an integer, got {value!r}.")
        return _MISSING
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        errors.append(f"{path} must be a number, got {value!r}.")
        return _MISSING
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        errors.append(f"{path} must be a string, got {value!r}.")
        return _MISSING
    return value


def build_dataclass(cls: type, data: dict[str, Any], path: str, errors: list[str]) -> Any:
    """Build ``cls`` from ``data``, appending every problem to ``errors`` (unknown keys get a hint)."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            errors.append(f"{full} is not a field of {cls.__name__}{hint}")
            continue
        converted = _convert(value, hints[key], full, errors)
        if converted is not _MISSING:
            kwargs[key] = converted
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - every field has a default
        errors.append(f"{path or 'config'}: {e}")
        return cls()


def _range_errors(cfg: RootConfig) -> list[str]:
    errs: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errs.append(msg)

    s, lo, ro, tr, pk, sv = cfg.sampling, cfg.loss, cfg.rollout, cfg.trainer, cfg.packing, cfg.server
    need(
        s.num_generations >= 2,
        f"sampling.num_generations ({s.num_generations}) must be >= 2: "
        "GRPO normalizes rewards within a group.",
    )
    need(s.max_completion_length >= 1, "sampling.max_completion_length must be >= 1.")
    need(s.temperature >= 0, f"sampling.temperature ({s.temperature}) must be >= 0.")
    need(0 < s.top_p <= 1, f"sampling.top_p ({s.top_p}) must be in (0, 1].")
    need(s.top_k >= 0, f"sampling.top_k ({s.top_k}) must be >= 0 (0 disables).")
    need(0 <= s.min_p <= 1, f"sampling.min_p ({s.min_p}) must be in [0, 1].")
    need(s.repetition_penalty > 0, "sampling.repetition_penalty must be > 0 (1.0 disables).")
    need(s.num_sampler_logprobs >= 0, "sampling.num_sampler_logprobs must be >= 0.")
    need(
        s.sampling_mask in ("auto", "required", "off"),
        f"sampling.sampling_mask ({s.sampling_mask!r}) must be one of auto, required, off.",
    )
    need(
        s.max_mask_candidates >= 1,
        f"sampling.max_mask_candidates ({s.max_mask_candidates}) must be >= 1: it caps each token's candidate set.",
    )
    need(
        0 < lo.vllm_importance_sampling_clip_min <= 1 <= lo.vllm_importance_sampling_clip_max,
        f"loss.vllm_importance_sampling_clip_min/max ({lo.vllm_importance_sampling_clip_min}, "
        f"{lo.vllm_importance_sampling_clip_max}) must satisfy 0 < min <= 1 <= max.",
    )
    need(0 <= lo.epsilon < 1, f"loss.epsilon ({lo.epsilon}) must be in [0, 1).")
    need(lo.epsilon_high is None or lo.epsilon_high >= 0, "loss.epsilon_high must be >= 0 or null.")
    need(ro.max_concurrent_rollouts >= 1, "rollout.max_concurrent_rollouts must be >= 1.")
    need(ro.max_staleness >= 0, "rollout.max_staleness must be >= 0.")
    need(ro.weight_sync_steps >= 1, "rollout.weight_sync_steps must be >= 1.")
    need(ro.rollout_worker_timeout > 0, "rollout.rollout_worker_timeout must be > 0 seconds.")
    need(ro.score_queue_maxsize >= 1, "rollout.score_queue_maxsize must be >= 1.")
    need(tr.gradient_accumulation_steps >= 1, "trainer.gradient_accumulation_steps must be >= 1.")
    need(tr.learning_rate >= 0, "trainer.learning_rate must be >= 0.")
    need(
        tr.max_steps > 0 or tr.num_train_epochs > 0,
        "set trainer.max_steps > 0 or trainer.num_train_epochs > 0: otherwise training never starts.",
    )
    need(tr.save_steps >= 0, "trainer.save_steps must be >= 0 (0: save only at the end).")
    need(
        tr.lr_scheduler_type in ("constant", "constant_with_warmup", "linear", "cosine"),
        f"trainer.lr_scheduler_type ({tr.lr_scheduler_type!r}) must be one of constant, "
        "constant_with_warmup, linear, cosine.",
    )
    need(
        tr.lr_scheduler_type in ("constant", "constant_with_warmup") or tr.max_steps > 0,
        f"trainer.lr_scheduler_type={tr.lr_scheduler_type} decays over trainer.max_steps: set trainer.max_steps "
        "(the step count of an epoch-based run is unknown in advance).",
    )
    need(tr.device in ("auto", "cpu", "cuda"), f"trainer.device ({tr.device!r}) must be auto, cpu or cuda.")
    need(
        tr.mixed_precision in (None, "bfloat16"),
        f"trainer.mixed_precision ({tr.mixed_precision!r}) must be bfloat16 or null (float16 would need loss "
        "scaling, which the trainer does not do).",
    )
    need(
        tr.mixed_precision is None or cfg.model.dtype == "float32",
        f"trainer.mixed_precision={tr.mixed_precision} keeps fp32 master weights: set model.dtype=float32 (not "
        f"{cfg.model.dtype!r}), or trainer.mixed_precision=null to train in model.dtype.",
    )
    need(
        not (tr.cpu_offload and tr.device == "cpu"),
        "trainer.cpu_offload=true moves FSDP2 shards off a GPU, but trainer.device=cpu: set trainer.cpu_offload=false.",
    )
    need(
        cfg.model.dtype in ("auto", "bfloat16", "float16", "float32"),
        f"model.dtype ({cfg.model.dtype!r}) must be one of auto, bfloat16, float16, float32.",
    )
    need(
        cfg.model.attn_implementation in ATTN_CHOICES,
        f"model.attn_implementation ({cfg.model.attn_implementation!r}) must be one of {', '.join(ATTN_CHOICES)} "
        "(flash kernels would ignore a packed row's attention mask).",
    )
    need(
        not (cfg.model.attn_implementation == "flex_attention" and tr.device == "cpu"),
        "model.attn_implementation=flex_attention needs trainer.device=cuda (flex attention has no CPU "
        "backward): use model.attn_implementation=auto or sdpa on CPU.",
    )
    need(pk.token_budget is None or pk.token_budget > 0, "packing.token_budget must be > 0 or null.")
    need(sv.timeout > 0 and sv.startup_timeout > 0, "server.timeout and server.startup_timeout must be > 0.")
    need(sv.max_retries >= 0, "server.max_retries must be >= 0.")
    nc = sv.nccl
    need(
        nc.num_buffers >= 1 and nc.buffer_size_bytes >= 1,
        "server.nccl.num_buffers and server.nccl.buffer_size_bytes must be >= 1.",
    )
    need(
        nc.timeout > 0 and nc.init_timeout > 0,
        "server.nccl.timeout and server.nccl.init_timeout must be > 0.",
    )
    if sv.weight_sync == "nccl":
        need(
            tr.device != "cpu",
            "server.weight_sync=nccl broadcasts from the trainer's GPU: set trainer.device=cuda (or auto), or "
            "server.weight_sync=disk.",
        )
        need(
            sv.backend != "embedded" or sv.embedded.device.startswith("cuda"),
            f"server.weight_sync=nccl needs the embedded server on a GPU (server.embedded.device is "
            f"{sv.embedded.device!r}): set server.embedded.device=cuda:1 (another GPU than the trainer's), or "
            "server.weight_sync=disk.",
        )
    emb = sv.embedded
    need(0 <= emb.port < 65536, f"server.embedded.port ({emb.port}) must be in [0, 65535] (0: a free port).")
    need(
        emb.max_model_len > 0 and emb.max_num_seqs > 0,
        "server.embedded.max_model_len/max_num_seqs must be > 0.",
    )
    if sv.backend == "embedded":
        need(
            s.max_completion_length < emb.max_model_len,
            f"sampling.max_completion_length ({s.max_completion_length}) must be below "
            f"server.embedded.max_model_len ({emb.max_model_len}) to leave room for the prompt.",
        )
    if pk.token_budget is not None:
        need(
            pk.token_budget > s.max_completion_length,
            f"packing.token_budget ({pk.token_budget}) must exceed sampling.max_completion_length "
            f"({s.max_completion_length}) plus the prompt: raise packing.token_budget or lower "
            "sampling.max_completion_length.",
        )
    need(cfg.logging.logging_steps >= 1, "logging.logging_steps must be >= 1.")
    need(cfg.data.num_examples is None or cfg.data.num_examples > 0, "data.num_examples must be > 0 or null.")
    need(len(cfg.rewards.funcs) > 0, "rewards.funcs is empty: give at least one reward function.")
    return errs


def _reward_name(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("name"), str):
        return entry["name"]
    return None


def _plugin_errors(cfg: RootConfig) -> list[str]:
    errs: list[str] = []
    checks = [
        ("loss", cfg.loss.name),
        ("packer", cfg.packing.kind),
        ("server", cfg.server.backend),
        ("weight_sync", cfg.server.weight_sync),
        ("rollout_loop", cfg.rollout.loop),
        ("dataset", cfg.data.source),
    ]
    for i, entry in enumerate(cfg.rewards.funcs):
        name = _reward_name(entry)
        if name is None:
            errs.append(
                f"rewards.funcs[{i}] ({entry!r}) must be a name, 'module:object', or {{name: ..., options}}."
            )
        else:
            checks.append(("reward", name))
    if registry.is_builtin(cfg.model.name_or_path):
        checks.append(("model", registry.builtin_name(cfg.model.name_or_path)))
    for kind, name in checks:
        msg = registry.check(kind, name)
        if msg:
            errs.append(msg)
    return errs


def to_root_config(data: Any) -> RootConfig:
    """Validate a composed config and return the typed ``RootConfig``; raise ``ConfigError`` listing every problem."""
    if not isinstance(data, dict):
        from omegaconf import OmegaConf

        data = OmegaConf.to_container(data, resolve=True)
    data = {k: v for k, v in data.items() if k != "hydra"}
    errors: list[str] = []
    cfg = build_dataclass(RootConfig, data, "", errors)
    if not errors:
        errors += _range_errors(cfg)
        errors += _plugin_errors(cfg)
        errors += lora_policy.config_errors(cfg)
    if errors:
        raise ConfigError(errors)
    lora_policy.derive_defaults(cfg)
    return cfg


def check_override_keys(overrides: list[str]) -> list[str]:
    """Check ``key=value`` command-line overrides against the schema before Hydra sees them.

    Hydra's own message for a typo ("Key 'temprature' is not in struct") has no hint; this one does.
    Group selections (``model=tiny``) and ``hydra.*`` keys are left to Hydra.
    """
    errors: list[str] = []
    for ov in overrides:
        if "=" not in ov:
            continue
        key = ov.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra") or "." not in key:
            continue
        cls: Any = RootConfig
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not dataclasses.is_dataclass(cls):
                break
            hints = get_type_hints(cls)
            if part not in hints:
                prefix = ".".join(parts[:i])
                close = difflib.get_close_matches(part, list(hints), n=1, cutoff=0.6)
                hint = (
                    f"; did you mean '{prefix}.{close[0]}'?" if close else f"; valid keys: {', '.join(hints)}"
                )
                errors.append(f"{key} is not a field of {cls.__name__}{hint}")
                break
            _, cls = _is_optional(hints[part])
    return errors
