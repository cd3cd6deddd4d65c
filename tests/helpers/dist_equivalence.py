"""Two optimizer steps on fixed rows, under torchrun (FSDP2, gloo) or in one process (rows as micro-batches).

Writes the step losses and the full parameters (rank 0) to --out, so a test can compare world sizes.
Usage: [torchrun --nproc-per-node 2] python tests/helpers/dist_equivalence.py --model DIR --out FILE
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from asyncgrpo_cli.bench.trainer_overhead import synthetic_groups
from asyncgrpo_cli.config.schema import LossConfig, ModelConfig, PackingConfig, TrainerConfig
from asyncgrpo_cli.model.loading import load_policy
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.train.distributed import (
    destroy_distributed,
    init_distributed,
    iter_full_state,
    shard_model,
)
from asyncgrpo_cli.train.losses import ClippedLoss, ScoreCenteringLoss
from asyncgrpo_cli.train.optim import build_optimizer, build_scheduler
from asyncgrpo_cli.train.step import clip_and_step, forward_backward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--loss", default="score_centering")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cpu")
    info = init_distributed(device, timeout_s=120)
    model = load_policy(args.model, ModelConfig(name_or_path=args.model, gradient_checkpointing=True), device)
    model = shard_model(model, info, device, mixed_precision=None, cpu_offload=False)
    tcfg = TrainerConfig(learning_rate=1e-2, max_grad_norm=1.0)
    optimizer, loss_fn = build_optimizer(model, tcfg), {"score_centering": ScoreCenteringLoss,
                                                         "clipped": ClippedLoss}[args.loss](LossConfig())
    scheduler = build_scheduler(optimizer, tcfg)
    packer = SequencePacker(PackingConfig())
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(2):
        samples = synthetic_groups(rng, 2, 3, prompt_len=12, completion_len=20, vocab=model.config.vocab_size,
                                   num_topk=4)
        base = -float(np.log(model.config.vocab_size))  # a random model is near uniform: ratios near 1
        for s in samples:
            s.sampler_logprobs[s.train_mask] = base + rng.normal(0, 0.2, s.num_trained)
            s.topk_logprobs = (base + rng.normal(0, 0.2, s.topk_logprobs.shape)).astype(np.float32)
        blank = samples[-1]  # a sample without trained tokens rides along
        blank.train_mask[:] = False
        blank.topk_ids = blank.topk_logprobs = None
        rows = [samples[:3], samples[3:]]  # two rows: one per rank, or two micro-batches in one process
        num_trained = sum(s.num_trained for s in samples)
        mine = [rows[info.rank]] if info.enabled else rows
        res = forward_backward(model, mine, num_trained, packer, loss_fn, device, 1.0, info.world_size)
        total = torch.tensor([res.loss], dtype=torch.float64)
        if info.enabled:
            torch.distributed.all_reduce(total)
        losses.append(float(total))
        clip_and_step(model, optimizer, scheduler, tcfg.max_grad_norm)
    state = {name: t for name, t in iter_full_state(model, info)}
    if info.is_main:
        torch.save({"losses": losses, "params": state}, args.out)
    destroy_distributed()


if __name__ == "__main__":
    main()
