"""AdamW, the LR schedule (constant by default: an epoch-based run's step count is unknown in advance) and the
gradient clip.

The clip works on the local shards of FSDP2's DTensor gradients. ``torch.nn.utils.clip_grad_norm_`` takes the
DTensors themselves: its ``_foreach_norm``, ``stack`` and ``_foreach_mul_`` each go through DTensor's dispatch
over every parameter, which kept the host busy for milliseconds at the end of every step while the GPU waited
(the idle report of ``trainer.profile``). The same arithmetic on the local tensors is the same kernels: each
shard's norm, their 2-norm, then the reduction DTensor's partial norm does (square, all-reduce sum over the
shard group, square root) and the same clamped coefficient, so the norm and the clipped gradients are bit for
bit those of ``clip_grad_norm_`` (tests/test_local_shards.py). Gradients it cannot read that way (other
placements, several meshes, CPU-offloaded shards of a GPU mesh) take ``clip_grad_norm_`` itself.

:class:`AdamW` is torch's, with the same move for its step. torch's step hands the DTensor parameters,
gradients and moments to its fused (or ``foreach``) kernel, and DTensor's dispatch then checks the shardings of
each tensor in Python, at the end of the step, where the GPU may wait for the update. Where each parameter, its
gradient and its moments are DTensors of one placement without a pending reduction (FSDP2's shards), the step
hands the kernel their local tensors instead: the same kernel on the same values, so the update is bit for bit
torch's (tests/test_local_shards.py). The moments stay DTensors in the optimizer's state, so checkpoints save and
reshard them as before. The first step (which creates the state), a closure, and any other layout take torch's
step itself. ``asyncgrpo bench optimizer`` measures both ways (clip + step of the 310 parameters of a Qwen3-0.6B
shape on an H100: 20.3 ms of host time on the DTensors, 8.1 on the local shards; docs/benchmarks.md).
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
    return AdamW(
        groups,
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        fused=fused or None,
    )


class AdamW(torch.optim.AdamW):
    """torch's AdamW whose steps run its kernel on FSDP2's local shards where it can (module docstring)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        groups = None if closure is not None else self.local_groups()
        if groups is None:
            torch_step = torch.optim.AdamW.step
            # torch's hook wrapper (once any torch AdamW exists): this class's own wrapper already ran the hooks
            if getattr(torch_step, "hooked", False):
                torch_step = torch_step.__wrapped__
            return torch_step(self, closure)
        from torch.optim.adam import adam

        for group, (params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps) in zip(self.param_groups, groups):
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adam(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_sqs,
                steps,
                amsgrad=group["amsgrad"],
                has_complex=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=False,
                fused=group["fused"],
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
        return None

    def local_groups(self) -> list[tuple[list[torch.Tensor], ...]] | None:
        """Per param group: the local tensors of the parameters that have a gradient, their gradients, moments
        (and AMSGrad maxima) and step counts, as torch's step would pass them to its kernel; None where the step
        must be torch's: no DTensor to unwrap, state not created yet, an implementation choice left to torch
        (neither ``fused`` nor ``foreach`` set), complex or sparse tensors, or DTensors of different meshes or
        placements, or with a pending reduction."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        out: list[tuple[list[torch.Tensor], ...]] = []
        unwrapped = False
        elementwise: dict[tuple[Any, ...], bool] = {}  # placements -> no pending reduction
        for group in self.param_groups:
            if group["differentiable"] or "decoupled_weight_decay" not in group:
                return None
            if not (group["fused"] or group["foreach"]):
                return None
            keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                state = self.state.get(p)
                if not state or "step" not in state or any(k not in state for k in keys):
                    return None
                # torch keeps the step count a plain tensor, also when it loads a state dict
                if isinstance(state["step"], DTensor):
                    return None
                if p.is_complex() or grad.is_sparse:
                    return None
                tensors = [p, grad] + [state[k] for k in keys]
                if isinstance(p, DTensor):
                    mesh, placements = p.device_mesh, p.placements
                    if placements not in elementwise:
                        elementwise[placements] = all(isinstance(pl, (Shard, Replicate)) for pl in placements)
                    if not elementwise[placements]:
                        return None
                    for t in tensors[1:]:
                        if not isinstance(t, DTensor) or t.placements != placements:
                            return None
                        if t.device_mesh is not mesh and t.device_mesh != mesh:
                            return None
                    tensors = [t.to_local() for t in tensors]
                    unwrapped = True
                elif any(isinstance(t, DTensor) for t in tensors):
                    return None
                for dest, t in zip(lists, tensors):
                    dest.append(t)
                lists[5].append(state["step"])
            out.append(lists)
        return out if unwrapped else None


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
