"""Where the shipped configs and the model cache live (checkout or installed wheel)."""

from __future__ import annotations

import os
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def conf_dir() -> Path:
    """The Hydra config directory: ``asyncgrpo_cli/_conf`` in a wheel, ``conf/`` in a checkout."""
    packaged = _PKG / "_conf"
    if (packaged / "config.yaml").is_file():
        return packaged
    checkout = _PKG.parent / "conf"
    if (checkout / "config.yaml").is_file():
        return checkout
    raise FileNotFoundError(f"asyncgrpo configs not found in {packaged} or {checkout}")


def recipes_dir() -> Path:
    """Recipes are the Hydra group ``recipe`` (``conf/recipe`` links to the top-level ``recipes/``)."""
    return conf_dir() / "recipe"


def list_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def cache_dir() -> Path:
    """Cache for built-in models (tiny test model, converted quickstart model). ``ASYNCGRPO_CACHE`` overrides."""
    root = os.environ.get("ASYNCGRPO_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "asyncgrpo"
