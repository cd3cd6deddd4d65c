"""Optimizer steps on fixed rows, under torchrun (FSDP2: gloo on CPU, NCCL on CUDA) or in one process (the rows
as micro-batches).

Writes the step losses and the full parameters after every step (rank 0) to --out, so a test can compare world
sizes. --save DIR writes a checkpoint (DCP) after the last step; --resume DIR loads one first and continues with
the rows of the following steps (the rows are the same whatever the world size or the starting step).
--check-gather compares the lockstep weight gather (``iter_full_state``) with DCP's full state dict.
--router-aux-coef C adds the MoE router aux loss (an MoE --model) and writes each step's mean row aux loss.

On CUDA the run asks for deterministic kernels (set CUBLAS_WORKSPACE_CONFIG=:4096:8 in its environment), so a
rank's row gives the same gradients as the same micro-batch in one process.

Usage: [torchrun --standalone --nproc-per-node N] python tests/helpers/dist_equivalence.py --model DIR --out FILE
       [--device cuda] [--mixed-precision bfloat16] [--cpu-offload] [--steps N] [--save DIR | --resume DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from asyncgrpo_cli.bench.trainer_overhead import synthetic_groups
from asyncgrpo_cli.config.schema import LossConfig, ModelConfig, PackingConfig, TrainerConfig
from asyncgrpo_cli.model.loading import load_policy
from asyncgrpo_cli.model.router import resolve_router_aux
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.samples import SAMPLER_TOPK
from asyncgrpo_cli.train.checkpoint import (
    TrainerState,
    load_training_state,
    read_resume_state,
    save_checkpoint,
)
from asyncgrpo_cli.train.distributed import (
    destroy_distributed,
    init_distributed,
    iter_full_state,
    shard_model,
)
from asyncgrpo_cli.train.losses import ClippedLoss, ScoreCenteringLoss
from asyncgrpo_cli.train.optim import build_optimizer, build_scheduler
from asyncgrpo_cli.train.run import pick_device
from asyncgrpo_cli.train.step import clip_and_step, forward_backward


def step_rows(vocab: int, num_steps: int, num_rows: int) -> list[tuple[list, int]]:
    """Each step's rows (one group of 3 samples each) and its trained-token count. Rank r trains rows r, r + world,
    ...; one process trains them all as micro-batches."""
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(num_steps):
        samples = synthetic_groups(
            rng, num_rows, 3, prompt_len=12, completion_len=20, vocab=vocab, num_topk=4
        )
        base = -float(np.log(vocab))  # a random model is near uniform: ratios near 1
        for s in samples:
            s.sampler_logprobs[s.train_mask] = base + rng.normal(0, 0.2, s.num_trained)
            top = s.token_extras[SAMPLER_TOPK]
            top.logprobs = (base + rng.normal(0, 0.2, top.logprobs.shape)).astype(np.float32)
        blank = samples[-1]  # a sample without trained tokens rides along
        blank.train_mask[:] = False
        blank.token_extras = {}
        rows = [samples[3 * r : 3 * r + 3] for r in range(num_rows)]
        steps.append((rows, sum(s.num_trained for s in samples)))
    return steps


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def check_gather(model, info) -> dict:
    """Rank 0: the lockstep gather equals DCP's full state dict, tensor for tensor, at full (unsharded) shapes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    mine = dict(iter_full_state(model, info))
    ref = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not info.is_main:
        return {}
    cfg = model.config
    assert set(ref) <= set(mine), sorted(set(ref) - set(mine))
    for name, tensor in ref.items():
        assert torch.equal(mine[name], tensor.to(mine[name].dtype)), name
    assert tuple(mine["model.embed_tokens.weight"].shape) == (cfg.vocab_size, cfg.hidden_size)
    return {"gathered": len(mine), "dtypes": sorted({str(t.dtype) for t in mine.values()})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--loss", default="score_centering")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--attn", default="sdpa", help="model.attn_implementation")
    parser.add_argument("--mixed-precision", default=None)
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2, help="rows per step; a multiple of the world size")
    parser.add_argument(
        "--save", default=None, help="run dir to write checkpoints/step-N into after the last step"
    )
    parser.add_argument("--resume", default=None, help="checkpoint dir to start from")
    parser.add_argument("--check-gather", action="store_true")
    parser.add_argument("--router-aux-coef", type=float, default=None, help="MoE router aux loss coefficient")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = pick_device(args.device)
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    info = init_distributed(device, timeout_s=120)
    model = load_policy(
        args.model,
        ModelConfig(name_or_path=args.model, gradient_checkpointing=True, attn_implementation=args.attn),
        device,
    )
    router = resolve_router_aux(model, args.router_aux_coef) if args.router_aux_coef is not None else None
    model = shard_model(
        model, info, device, mixed_precision=args.mixed_precision, cpu_offload=args.cpu_offload
    )
    tcfg = TrainerConfig(learning_rate=1e-2, max_grad_norm=1.0)
    optimizer, loss_fn = (
        build_optimizer(model, tcfg),
        {"score_centering": ScoreCenteringLoss, "clipped": ClippedLoss}[args.loss](LossConfig()),
    )
    scheduler = build_scheduler(optimizer, tcfg)
    state = TrainerState()
    if args.resume:
        state = read_resume_state(Path(args.resume)).trainer
        load_training_state(Path(args.resume), model, optimizer, scheduler, info)
    packer = SequencePacker(PackingConfig(kind="sequence"))
    losses, params_by_step, aux_means, grad_norms = [], {}, [], []
    for rows, num_trained in step_rows(model.config.vocab_size, state.step + args.steps, args.rows)[
        state.step :
    ]:
        mine = rows[info.rank :: info.world_size]
        res = forward_backward(
            model, mine, num_trained, packer, loss_fn, device, 1.0, info.world_size, router=router
        )
        total = torch.tensor([res.loss, res.aux_sum, res.aux_rows], dtype=torch.float64, device=device)
        if info.enabled:
            torch.distributed.all_reduce(total)
        losses.append(float(total[0]))
        if router is not None:
            aux_means.append(float(total[1] / total[2]))
        grad_norms.append(clip_and_step(model, optimizer, scheduler, tcfg.max_grad_norm))
        state.step += 1
        params_by_step[state.step] = {k: t.clone() for k, t in iter_full_state(model, info)}  # CPU: no alias
    out = {
        "losses": losses,
        "aux_means": aux_means,
        "grad_norms": grad_norms,
        "params": params_by_step[state.step],
        "params_by_step": params_by_step,
        "world_size": info.world_size,
        "shard_devices": sorted({_local(p).device.type for p in model.parameters()}),
    }
    if args.check_gather:
        out["gather"] = check_gather(model, info)
    if args.save:
        save_checkpoint(
            Path(args.save), model, None, optimizer, scheduler, state, {}, None, info, save_hf_model=False
        )
    if info.is_main:
        torch.save(out, args.out)
    destroy_distributed()


if __name__ == "__main__":
    main()
