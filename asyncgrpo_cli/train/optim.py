"""AdamW and the LR schedule (constant by default: an epoch-based run's step count is unknown in advance)."""

from __future__ import annotations

import math
from typing import Any

import torch

from asyncgrpo_cli.config.schema import TrainerConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = all(p.is_cuda for p in params) and bool(params)
    return torch.optim.AdamW(
        groups,
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        fused=fused or None,
    )


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Multiplier of the base LR after ``step`` optimizer steps."""
    warm = cfg.warmup_steps
    if warm > 0 and step < warm and cfg.lr_scheduler_type != "constant":
        return (step + 1) / warm
    if cfg.lr_scheduler_type in ("constant", "constant_with_warmup"):
        return 1.0
    total = max(cfg.max_steps - warm, 1)
    progress = min(max(step - warm, 0) / total, 1.0)
    if cfg.lr_scheduler_type == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
