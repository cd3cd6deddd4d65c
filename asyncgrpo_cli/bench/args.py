"""``KEY=VALUE`` arguments of the benchmarks (``asyncgrpo bench NAME KEY=VALUE ...``) into their config dataclass."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, get_origin, get_type_hints


def parse_key_values(cls: type, argv: list[str]) -> tuple[Any | None, list[str]]:
    """(the ``cls`` instance, None when any problem was found; every problem found). Values are YAML scalars; a
    ``list`` field takes its items comma-separated (``top_k=8,64``) or as a YAML list. Unknown keys and wrong
    types are named as ``bench.KEY`` by the config validator."""
    import yaml

    from asyncgrpo_cli.config.validate import build_dataclass

    hints = get_type_hints(cls)
    lists = {f.name for f in fields(cls) if get_origin(hints[f.name]) is list}
    data: dict[str, Any] = {}
    errors: list[str] = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq:
            errors.append(f"{arg!r} is not KEY=VALUE")
        elif key in lists and not value.startswith("["):
            data[key] = [yaml.safe_load(x) for x in value.split(",") if x]
        else:
            data[key] = yaml.safe_load(value)
    if errors:
        return None, errors
    cfg = build_dataclass(cls, data, "bench", errors)
    # a config with a wrong-typed field (the validator keeps a placeholder there) is no config to check further
    return (None if errors else cfg), errors
