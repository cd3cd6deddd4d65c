"""Register the typed schemas with Hydra's ConfigStore, under the ``schema`` group (out of the choice lists).

Every group file starts from its schema (``- /schema/GROUP@_here_``), so the composed config carries every key
with its type: ``trainer.max_steps=abc`` is rejected by Hydra, and the strict validator catches the rest.
"""

from __future__ import annotations

from asyncgrpo_cli.config import schema

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
