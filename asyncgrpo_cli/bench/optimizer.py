"""``asyncgrpo bench optimizer``: the end of a training step, the gradient clip and the AdamW step on FSDP2's
shards, torch's way on the DTensors against the project's on their local tensors (``train/optim``), side by side.

The model is a bench shape as ``asyncgrpo bench trainer`` builds it (a weightless checkpoint through
``load_policy``, FSDP2 with bf16 mixed precision over fp32 master weights, on one rank), with random gradients.
Both ways run fused AdamW (as the trainer does on CUDA) with a run's param groups and default hyper-parameters,
and clip at ``max_grad_norm``. Per shape:

  - exactness: from the same weights and gradients, two steps each way; ``exact`` says whether the weights and
    moments after them are equal bit for bit;
  - rounds alternating between the ways (A B B A ...), each from an idle device: ``host ms`` is the time until the
    clip and step calls return (at the end of a step the device waits for that launch work where the host has not
    run ahead), ``device ms`` the device's time for them (CUDA events; on CPU the same as host); medians per way.

Usage: asyncgrpo bench optimizer [shapes=0.6b,1.7b] [device=auto] [rounds=10] [max_grad_norm=1.0]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo_cli.errors import UserError

WAYS = ("torch (DTensors)", "local shards")


@dataclass
class OptimizerBenchConfig:
    shapes: str = "0.6b,1.7b"
    """Comma-separated bench shapes (``asyncgrpo bench trainer``'s: 0.6b, 1.7b, ..., tiny for CPU)."""
    device: str = "auto"
    rounds: int = 10
    max_grad_norm: float = 1.0


def _step(way: str, params: list, optimizer: Any, max_norm: float) -> None:
    import torch

    from asyncgrpo_cli.train.optim import clip_grad_norm

    if way == WAYS[0]:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        clip_grad_norm(params, max_norm)
    optimizer.step()


def _locals(tensors: list) -> list:
    """The local shards of DTensors (``shard_model`` shards every parameter here)."""
    return [t.to_local() for t in tensors]


def _optimizers(model: Any) -> dict[str, Any]:
    """Per way: torch's AdamW or the project's, on the param groups and hyper-parameters ``build_optimizer`` gives a
    run, fused as on CUDA (also on CPU, so both ways take the fused kernel there too)."""
    import torch

    from asyncgrpo_cli.config.schema import TrainerConfig
    from asyncgrpo_cli.train.optim import AdamW, build_optimizer

    groups = [{**g, "fused": True} for g in build_optimizer(model, TrainerConfig()).param_groups]
    return {WAYS[0]: torch.optim.AdamW(groups), WAYS[1]: AdamW([dict(g) for g in groups])}


def bench_shape(shape: str, cfg: OptimizerBenchConfig, device: Any, root: Path) -> dict[str, Any]:
    import torch

    from asyncgrpo_cli.bench.shapes import SHAPES, weightless_checkpoint
    from asyncgrpo_cli.config.schema import ModelConfig
    from asyncgrpo_cli.model.loading import load_policy
    from asyncgrpo_cli.train.distributed import DistInfo, shard_model

    torch.manual_seed(0)
    model_cfg = ModelConfig(name_or_path=shape, dtype="float32", gradient_checkpointing=False)
    model = load_policy(weightless_checkpoint(SHAPES[shape], root / shape), model_cfg, device)
    model = shard_model(model, DistInfo(), device, "bfloat16", cpu_offload=False)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in params:
            p.grad = p.detach().clone()
            p.grad.to_local().normal_()
    weights, grads = (
        [t.clone() for t in _locals(params)],
        [t.clone() for t in _locals([p.grad for p in params])],
    )
    optimizers = _optimizers(model)
    first: list | None = None  # the first way's weights and moments, in host memory (1.7B: 20 GB of them)
    exact = True
    for way, optimizer in optimizers.items():  # exactness: two steps each way from the same start
        with torch.no_grad():
            for t, w in zip(_locals(params), weights):
                t.copy_(w)
            for _ in range(2):
                for t, g in zip(_locals([p.grad for p in params]), grads):
                    t.copy_(g)
                _step(way, params, optimizer, cfg.max_grad_norm)
        state = [optimizer.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
        now = _locals(params) + _locals(state)
        if first is None:
            first = [t.to("cpu", copy=True) for t in now]
        else:
            exact = all(torch.equal(a, b.cpu()) for a, b in zip(first, now))
    del first
    times: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
    cuda = device.type == "cuda"
    for r in range(cfg.rounds + 2):  # two untimed rounds first
        way = WAYS[(r // 2 + r) % 2]
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        _step(way, params, optimizers[way], cfg.max_grad_norm)
        host = time.perf_counter() - t0
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
            dev = start.elapsed_time(end) / 1e3
        else:
            dev = host
        if r >= 2:
            times[way].append((host, dev))
    result: dict[str, Any] = {"shape": shape, "params": len(params), "exact": exact}
    for way in WAYS:
        result[way] = tuple(statistics.median(x[i] for x in times[way]) * 1e3 for i in range(2))
    return result


def main(argv: list[str]) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    from asyncgrpo_cli.bench.args import parse_key_values
    from asyncgrpo_cli.bench.shapes import SHAPES
    from asyncgrpo_cli.train.distributed import destroy_distributed
    from asyncgrpo_cli.train.run import pick_device

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    cfg, errors = parse_key_values(OptimizerBenchConfig, argv)
    if cfg is None:
        raise UserError("asyncgrpo bench optimizer: " + "; ".join(errors))
    shapes = cfg.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        raise UserError(f"bench.shapes: {', '.join(unknown)} unknown; pick from {', '.join(SHAPES)}")
    if cfg.rounds < 2:
        raise UserError(f"bench.rounds={cfg.rounds}: at least 2 (the ways alternate)")
    device = pick_device(cfg.device)
    hf_logging.set_verbosity_error()  # the weightless checkpoint's "newly initialized" report
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"clip (max_grad_norm={cfg.max_grad_norm}) + fused AdamW step, FSDP2 on one rank, {name}, torch "
        f"{torch.__version__}; {cfg.rounds} rounds alternating, medians"
    )
    print("| shape | parameters | way | host ms | device ms | exact |")
    print("|---|---|---|---|---|---|")
    try:
        with tempfile.TemporaryDirectory(prefix="asyncgrpo-bench-") as tmp:
            for shape in shapes:
                r = bench_shape(shape, cfg, device, Path(tmp))
                for way in WAYS:
                    host, dev = r[way]
                    print(
                        f"| {shape} | {r['params']} | {way} | {host:.2f} | {dev:.2f} | "
                        f"{'yes' if r['exact'] else 'NO'} |",
                        flush=True,
                    )
                (th, td), (lh, ld) = r[WAYS[0]], r[WAYS[1]]
                print(
                    f"  {shape}: local shards vs torch: host {th / lh:.2f}x less, device {td / ld:.2f}x",
                    flush=True,
                )
    finally:
        destroy_distributed()
