"""Composing configs outside ``hydra.main`` (check, serve, bench, tests), and the pre-Hydra argv checks."""

from __future__ import annotations

from typing import Any

from asyncgrpo_cli.config.schema import RootConfig
from asyncgrpo_cli.config.validate import check_override_keys, to_root_config
from asyncgrpo_cli.errors import ConfigError, UserError
from asyncgrpo_cli.paths import conf_dir, list_recipes

DEFAULT_RECIPE = "quickstart"
_RECIPE_KEYS = ("recipe=", "+recipe=", "++recipe=")


def with_default_recipe(overrides: list[str]) -> list[str]:
    """``quickstart`` is the recipe when none is given."""
    if any(o.startswith(_RECIPE_KEYS) for o in overrides):
        return list(overrides)
    return [*overrides, f"+recipe={DEFAULT_RECIPE}"]


def recipe_names(overrides: list[str]) -> list[str]:
    names: list[str] = []
    for o in overrides:
        if o.startswith(_RECIPE_KEYS):
            value = o.split("=", 1)[1].strip()
            if value.startswith(("choice(", "range(", "glob(")):
                continue
            names += [v.strip() for v in value.split(",") if v.strip()]
    return names


def precheck(overrides: list[str]) -> None:
    """Fail early, with hints, on unknown recipes and unknown config keys (before Hydra's terser errors)."""
    available = list_recipes()
    for name in recipe_names(overrides):
        if name not in available:
            raise UserError(
                f"recipe {name!r} does not exist; available recipes: {', '.join(available)} "
                f"(files in recipes/)."
            )
    errors = check_override_keys([o for o in overrides if not o.startswith(_RECIPE_KEYS)])
    if errors:
        raise ConfigError(errors)


def compose_dict(overrides: list[str]) -> Any:
    """Compose ``config.yaml`` with ``overrides`` (no run directory, no logging setup); returns a DictConfig."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from asyncgrpo_cli.config.store import register_schemas

    register_schemas()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None, job_name="asyncgrpo"):
            return compose(config_name="config", overrides=list(overrides))
    except HydraException as e:
        raise UserError(f"could not compose the config: {e}") from e


def compose_config(overrides: list[str], default_recipe: bool = True) -> RootConfig:
    """Compose and strictly validate; the path ``check``, ``serve`` and ``bench`` use."""
    overrides = with_default_recipe(overrides) if default_recipe else list(overrides)
    precheck(overrides)
    return to_root_config(compose_dict(overrides))
