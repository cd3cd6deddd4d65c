"""AdamW, the LR schedule (constant by default: an epoch-based run's step count is unknown in advance) and the
gradient clip.

The clip works on the local shards of FSDP2's DTensor gradients. ``torch.nn.utils.clip_grad_norm_`` takes the
DTensors themselves: its ``_foreach_norm``, ``stack`` and ``_foreach_mul_`` each go through DTensor's dispatch
over every parameter, which kept the host busy for milliseconds at the end of every step while the GPU waited
(the idle report of ``trainer.profile``). The same arithmetic on the local tensors is the same kernels: each
shard's norm, their 2-norm, then the reduction DTensor's partial norm does (square, all-reduce sum over the
shard group, square root) and the same clamped coefficient, so the norm and the clipped gradients are bit for
bit those of ``clip_grad_norm_`` (tests/test_clip.py). Gradients it cannot read that way (other placements,
several meshes, CPU-offloaded shards of a GPU mesh) take ``clip_grad_norm_`` itself.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

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


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``params`` to a total 2-norm of ``max_norm`` (``inf``: measure only); returns the
    pre-clip norm as a plain tensor on the gradients' device, not read back (module docstring)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    local = _local_shards(grads)
    if local is None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    shards, group = local
    norm = torch.nn.utils.get_total_norm(shards, 2.0)
    if group is not None:  # DTensor's partial 2-norm: x^2, sum over the group, x^(1/2), also on one rank
        norm = norm**2
        dist.all_reduce(norm, group=group)
        norm = norm ** (1.0 / 2.0)
    if not math.isinf(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(shards, coef)
    return norm


def _local_shards(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any] | None:
    """The tensors to clip in place and the process group to reduce the norm over (None: plain tensors, nothing
    to reduce); None where the gradients are not all plain or all dim-sharded on one 1-D mesh of their device."""
    from torch.distributed.tensor import DTensor, Shard

    dtensors = [g for g in grads if isinstance(g, DTensor)]
    if not dtensors:
        return grads, None
    if len(dtensors) != len(grads):
        return None
    mesh = dtensors[0].device_mesh
    if mesh.ndim != 1:
        return None
    if any(
        g.device_mesh is not mesh or not all(isinstance(pl, Shard) for pl in g.placements) for g in dtensors
    ):
        return None
    shards = [g.to_local() for g in dtensors]
    if any(t.device.type != mesh.device_type for t in shards):
        return None
    return shards, mesh.get_group()
