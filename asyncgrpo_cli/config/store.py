"""Register the typed schemas with Hydra's ConfigStore, under the ``schema`` group (out of the choice lists), and
write a typed config back as YAML (``resolved.yaml``).

Every group file starts from its schema (``- /schema/GROUP@_here_``), so the composed config carries every key
with its type: ``trainer.max_steps=abc`` is rejected by Hydra, and the strict validator catches the rest.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from asyncgrpo_cli.config import schema
from asyncgrpo_cli.config.schema import RootConfig

GROUPS = {
    "model": schema.ModelConfig,
    "server": schema.ServerConfig,
    "sampling": schema.SamplingConfig,
    "packing": schema.PackingConfig,
    "rewards": schema.RewardsConfig,
    "loss": schema.LossConfig,
    "rollout": schema.RolloutConfig,
    "trainer": schema.TrainerConfig,
    "data": schema.DataConfig,
    "logging": schema.LoggingConfig,
    "teacher": schema.TeacherConfig,
}

_registered = False


def register_schemas() -> None:
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group, node in GROUPS.items():
        cs.store(group="schema", name=group, node=node)
    _registered = True


def resolved_yaml(cfg: RootConfig) -> str:
    """The validated config, defaults filled (``to_root_config``), as YAML: ``RUN_DIR/resolved.yaml`` holds
    exactly the config that ran, and ``to_root_config`` of it gives the same config back."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))


def write_resolved(cfg: RootConfig, path: Path) -> None:
    path.write_text(resolved_yaml(cfg))
