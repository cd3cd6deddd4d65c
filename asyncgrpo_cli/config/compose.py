"""Composing configs outside ``hydra.main`` (check, serve, bench, tests), and the pre-Hydra argv checks."""

from __future__ import annotations

from typing import Any

from asyncgrpo_cli.config.schema import RootConfig
from asyncgrpo_cli.config.validate import check_override_keys, to_root_config
from asyncgrpo_cli.errors import ConfigError, UserError
from asyncgrpo_cli.paths import conf_dir, list_recipes, recipes_dir

DEFAULT_RECIPE = "quickstart"
_RECIPE_KEYS = ("recipe=", "+recipe=", "++recipe=")

PRIMARY_CONFIGS = {"grpo": "config", "distill": "distill"}
"""``algorithm`` -> the primary config (``conf/NAME.yaml``) its verb composes."""
DEFAULT_RECIPES = {"grpo": DEFAULT_RECIPE, "distill": "distill_quickstart"}
"""``algorithm`` -> the recipe its verb runs when none is given (the offline quickstarts)."""
VERBS = {"grpo": "train", "distill": "distill"}


def with_default_recipe(overrides: list[str], algorithm: str = "grpo") -> list[str]:
    """The algorithm's quickstart is the recipe when none is given."""
    if any(o.startswith(_RECIPE_KEYS) for o in overrides):
        return list(overrides)
    return [*overrides, f"+recipe={DEFAULT_RECIPES[algorithm]}"]


def recipe_algorithm(name: str) -> str:
    """The ``algorithm`` a recipe file declares (``grpo`` when it declares none); reads the YAML, composes nothing."""
    import yaml

    path = recipes_dir() / f"{name}.yaml"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "grpo"
    value = data.get("algorithm", "grpo") if isinstance(data, dict) else "grpo"
    return value if value in PRIMARY_CONFIGS else "grpo"


def algorithm_of(overrides: list[str], verb_algorithm: str | None = None) -> str:
    """Which primary config ``overrides`` compose: the verb's (``train``: grpo, ``distill``: distill), checked
    against the recipes it names; for ``check``, ``serve`` and ``bench`` (``verb_algorithm`` None) the recipes'."""
    declared = {n: recipe_algorithm(n) for n in recipe_names(overrides) if n in list_recipes()}
    if verb_algorithm is None:
        found = set(declared.values())
        if len(found) > 1:
            raise UserError(
                f"the recipes {', '.join(declared)} mix algorithms ({', '.join(sorted(found))}): sweep recipes "
                "of one verb at a time."
            )
        return found.pop() if found else "grpo"
    for name, algorithm in declared.items():
        if algorithm != verb_algorithm:
            raise UserError(
                f"recipe {name!r} is a {algorithm} recipe: run it with `asyncgrpo {VERBS[algorithm]} "
                f"+recipe={name}` (asyncgrpo {VERBS[verb_algorithm]} runs {verb_algorithm} recipes)."
            )
    return verb_algorithm


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


def compose_dict(overrides: list[str], algorithm: str = "grpo") -> Any:
    """Compose the algorithm's primary config with ``overrides`` (no run directory, no logging setup); returns a
    DictConfig."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from asyncgrpo_cli.config.store import register_schemas

    register_schemas()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None, job_name="asyncgrpo"):
            return compose(config_name=PRIMARY_CONFIGS[algorithm], overrides=list(overrides))
    except HydraException as e:
        raise UserError(f"could not compose the config: {e}") from e


def compose_config(
    overrides: list[str], default_recipe: bool = True, algorithm: str | None = None
) -> RootConfig:
    """Compose and strictly validate; the path ``check``, ``serve`` and ``bench`` use. ``algorithm`` None: the one
    the named recipes declare (``grpo`` without a recipe)."""
    precheck(overrides)
    algorithm = algorithm_of(overrides, algorithm)
    overrides = with_default_recipe(overrides, algorithm) if default_recipe else list(overrides)
    return to_root_config(compose_dict(overrides, algorithm))
