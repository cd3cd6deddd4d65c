"""The trainer's step path with ``trainer.compile`` on, over rows of changing length: what compiled at each step.

The same functions ``asyncgrpo train`` runs (``train/run.py``, ``train/trainer.py``): ``load_policy``,
``maybe_compile_decoder_layers``, ``shard_model``, AdamW, then per step the packer, ``forward_backward`` and
``clip_and_step``. Used by ``tests/test_compile.py`` (CPU, SDPA) and ``tests/gpu/test_compile_gpu.py`` (CUDA,
flex attention, FSDP2).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncgrpo_cli import registry
from asyncgrpo_cli.bench.trainer_overhead import synthetic_groups
from asyncgrpo_cli.config.schema import LossConfig, ModelConfig, PackingConfig, TrainerConfig
from asyncgrpo_cli.model.loading import load_policy
from asyncgrpo_cli.model.resolve import resolve_model_path
from asyncgrpo_cli.train.compile import compile_meter, maybe_compile_decoder_layers
from asyncgrpo_cli.train.distributed import DistInfo, destroy_distributed, shard_model
from asyncgrpo_cli.train.optim import build_optimizer, build_scheduler
from asyncgrpo_cli.train.step import clip_and_step, forward_backward

COMPLETIONS = (16, 28, 44, 20, 60, 36)
"""Completion lengths of the steps' groups: every step's row has another length (all under 1024 tokens, so one
flex-attention bucket on CUDA)."""


@dataclass
class Steps:
    lengths: list[int] = field(default_factory=list)
    """Forwarded tokens of each step's row."""
    graphs: list[int] = field(default_factory=list)
    """Graphs dynamo compiled from the first step to the end of each step (its ``unique_graphs`` counter, which
    ``torch._dynamo.reset()`` does not clear, minus its value before the first step)."""
    compiles: list[tuple[float, int]] = field(default_factory=list)
    """The :class:`CompileMeter`'s (seconds, compiles) of each step."""
    graph_breaks: list[str] = field(default_factory=list)
    """The graph-break reasons the meter reported over the steps (the trainer warns of each)."""
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)


def run_steps(
    device: torch.device,
    compile_setting: object,
    *,
    model: str = "builtin:tiny-qwen3",
    packing: str = "tree",
    mixed_precision: str | None = None,
    lora: bool = False,
    completions: tuple[int, ...] = COMPLETIONS,
) -> Steps:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    path = resolve_model_path(model)
    model_cfg = ModelConfig(name_or_path=path)
    model_cfg.lora.enabled = lora
    torch.manual_seed(0)
    policy = load_policy(path, model_cfg, device)
    vocab = policy.config.vocab_size
    maybe_compile_decoder_layers(policy, compile_setting, device)
    policy = shard_model(policy, DistInfo(), device, mixed_precision, cpu_offload=False)
    tcfg = TrainerConfig(learning_rate=1e-4, mixed_precision=mixed_precision, compile=compile_setting)
    optimizer = build_optimizer(policy, tcfg)
    scheduler = build_scheduler(optimizer, tcfg)
    pcfg = PackingConfig(kind=packing)
    packer = registry.resolve("packer", pcfg.kind)(pcfg)
    loss_fn = registry.resolve("loss", "clipped")(LossConfig(name="clipped"))
    meter = compile_meter()
    meter.take()  # from here on: what the steps compile
    out = Steps()
    start = counters["stats"]["unique_graphs"]
    rng = np.random.default_rng(0)
    try:
        for completion in completions:
            samples = synthetic_groups(rng, 2, 3, 12, completion, vocab=vocab, num_topk=0)
            for sample in samples:  # a random policy's log-probs: importance ratios near 1, none masked
                sample.sampler_logprobs[sample.train_mask] = -math.log(vocab)
            t0 = time.perf_counter()
            num_trained = sum(s.num_trained for s in samples)
            res = forward_backward(policy, [samples], num_trained, packer, loss_fn, device, 1.0)
            out.grad_norms.append(clip_and_step(policy, optimizer, scheduler, tcfg.max_grad_norm))
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.step_s.append(time.perf_counter() - t0)
            out.lengths.append(res.forwarded)
            out.graphs.append(counters["stats"]["unique_graphs"] - start)
            cost = meter.take()
            out.compiles.append((cost.seconds, cost.count))
            out.graph_breaks.extend(cost.graph_breaks)
            out.losses.append(res.loss)
    finally:
        destroy_distributed()  # shard_model's one-rank group, when it made one
    return out
