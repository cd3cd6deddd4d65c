"""``asyncgrpo bench trainer-overhead``: planning + packing + collating per optimizer step, as a fraction of the
forward+backward time of the same step, measured side by side on synthetic GRPO groups (no server).

Usage: asyncgrpo bench trainer-overhead [+recipe=tiny] [OVERRIDES] [--steps N] [--prompt-len P]
       [--completion-len C]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def synthetic_groups(
    rng: np.random.Generator,
    num_groups: int,
    group_size: int,
    prompt_len: int,
    completion_len: int,
    vocab: int,
    num_topk: int,
):
    from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK, TrainingSequence

    samples = []
    for g in range(num_groups):
        prompt = rng.integers(10, vocab, size=prompt_len)
        for _ in range(group_size):
            n = int(rng.integers(completion_len // 2, completion_len + 1))
            ids = np.concatenate([prompt, rng.integers(10, vocab, size=n)]).astype(np.int64)
            mask = np.zeros(len(ids), dtype=bool)
            mask[prompt_len:] = True
            lps = np.where(mask, -rng.random(len(ids)) * 3, 0.0).astype(np.float32)
            extras = {}
            if num_topk:
                topk_ids = rng.integers(10, vocab, size=(n, num_topk)).astype(np.int64)
                topk_lps = np.sort(-rng.random((n, num_topk)) * 5, axis=1)[:, ::-1].astype(np.float32)
                extras[SAMPLER_TOPK] = TopK(topk_ids, topk_lps)
            samples.append(
                TrainingSequence(
                    input_ids=ids,
                    train_mask=mask,
                    sampler_logprobs=lps,
                    advantage=float(rng.normal()),
                    token_extras=extras,
                    group_id=g,
                    prompt_seq=g,
                    group_num_samples=group_size,
                )
            )
    return samples


def main(argv: list[str]) -> None:
    import torch

    from asyncgrpo_cli import registry
    from asyncgrpo_cli.bench.planning import plan
    from asyncgrpo_cli.config.compose import compose_config
    from asyncgrpo_cli.model.loading import load_policy
    from asyncgrpo_cli.model.logprobs import token_logprobs
    from asyncgrpo_cli.model.resolve import resolve_model_path
    from asyncgrpo_cli.packing import planner_for

    parser = argparse.ArgumentParser(prog="asyncgrpo bench trainer-overhead")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=96)
    args, overrides = parser.parse_known_args(argv)
    if not any(o.startswith(("+recipe=", "recipe=")) for o in overrides):
        overrides = ["+recipe=tiny", *overrides]
    cfg = compose_config(overrides)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    budget = cfg.packing.token_budget or cfg.server.embedded.max_model_len
    model = load_policy(resolve_model_path(cfg.model.name_or_path), cfg.model, torch.device("cpu"))
    loss_fn = registry.resolve("loss", cfg.loss.name)(cfg.loss)
    packer = registry.resolve("packer", cfg.packing.kind)(cfg.packing)
    with_topk = bool(loss_fn.needs)  # as train/step.py: the head scores the row's top-k extras
    rng = np.random.default_rng(0)
    G = cfg.sampling.num_generations
    per_group = args.prompt_len * G + args.completion_len * G
    groups_per_step = max(1, (budget * cfg.trainer.gradient_accumulation_steps) // per_group + 1)
    overhead, compute = [], []
    for step in range(args.steps + 1):  # step 0 warms up
        samples = synthetic_groups(
            rng,
            groups_per_step,
            G,
            args.prompt_len,
            args.completion_len,
            model.config.vocab_size,
            cfg.sampling.num_sampler_logprobs,
        )
        t0 = time.perf_counter()
        planner = planner_for(packer)(budget, num_ranks=1)
        mbs = plan(planner, samples, G)  # a group a call, as the trainer plans them
        rows = [packer.pack(mb.rows[0]) for mb in mbs]
        t_plan = time.perf_counter() - t0
        n_trained = sum(r.num_trained for r in rows)
        t1 = time.perf_counter()
        for row in rows:
            stats = token_logprobs(model, row, cfg.sampling.temperature or 1.0, with_topk)
            loss, _ = loss_fn(stats, row, n_trained)
            loss.backward()
        model.zero_grad(set_to_none=True)
        t_compute = time.perf_counter() - t1
        if step > 0:
            overhead.append(t_plan)
            compute.append(t_compute)
    tokens = sum(len(s) for s in samples)
    med_o, med_c = statistics.median(overhead), statistics.median(compute)
    print(
        f"model {cfg.model.name_or_path}, token_budget {budget}, {len(samples)} samples / {tokens} tokens "
        f"per step, {len(rows)} micro-batch(es), torch threads {torch.get_num_threads()}"
    )
    print(f"plan+pack+collate per step: {med_o * 1e3:.2f} ms (median of {args.steps})")
    print(f"forward+backward per step:  {med_c * 1e3:.1f} ms")
    print(f"overhead / fwd+bwd = {med_o / med_c:.4f} ({100 * med_o / med_c:.2f}%)")
