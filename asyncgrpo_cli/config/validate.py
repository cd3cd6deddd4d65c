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
from asyncgrpo_cli.config.checks import value_errors
from asyncgrpo_cli.config.schema import RootConfig
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
        errors += value_errors(cfg)
        errors += _plugin_errors(cfg)
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
