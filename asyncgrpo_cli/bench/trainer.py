"""``asyncgrpo bench trainer``: trainer throughput, MFU and peak memory on synthetic packed rows (no server).

Usage (one process per GPU; rank 0 prints the table)::

    torchrun --standalone --nproc-per-node N -m asyncgrpo_cli bench trainer [KEY=VALUE ...]
    asyncgrpo bench trainer shapes=tiny device=cpu steps=2        # CPU smoke test

Keys (:class:`TrainerBenchConfig`): ``shapes=0.6b,1.7b`` (Qwen3 shapes; ``qwen3.5-2b``: Qwen3.5-2B's gated-DeltaNet
hybrid text decoder; ``tiny``, ``tiny-qwen3.5``: CPU smoke tests; random weights, built without the hub),
``linear_attention_kernel`` (model.linear_attention_kernel of hybrids: auto, torch, fla), ``lm_head_kernel``
(model.lm_head_kernel: auto, torch, triton; the head that ran is printed), ``flex_options`` (a ``bench attention``
candidate as model.flex_kernel_options),
``token_budget`` (forwarded tokens per row, one row per rank per micro-batch), ``grad_accum``, ``precision``,
``gradient_checkpointing``, ``compile``, ``reshard_after_forward``, ``one_rank_cast`` (trainer.one_rank_cast),
``packing``, ``attn``, ``steps``, ``warmup``,
``out=PATH`` (JSON), ``baseline=PATH`` (a 1-GPU JSON: adds scaling efficiency = tokens/s per GPU over the
baseline's), ``profile=N`` (N untimed steps after the timed ones under torch.profiler: where the step's GPU time
goes, by kernel kind, printed under the row; ``train/profiler.py``).

Each step is the trainer's own path: rank 0 builds the rows and hands them out (``rank_steps``, ``scatter_step``;
with several ranks it packs every rank's rows before the scatter, untimed, as the trainer packs them under the
step before; in a single process the step packs its rows, the next step's first under this step's GPU work, in
``forward_backward``'s ``overlap``, as the trainer packs it; ``packing.kind``), every rank runs
``forward_backward`` (decoder with the configured attention, the LM head of ``lm_head_kernel``, loss; the clip and
fused AdamW step queued behind the last backward, as the trainer queues them) and reduces the loss metrics. The
model comes from ``load_policy`` (a weightless checkpoint: every weight is initialized at random, seeded alike on
every rank; for hybrids the packed gated-DeltaNet forward with the resolved kernel, printed in the table's last
column) and FSDP2's ``shard_model``. Rows are filled to exactly ``token_budget`` forwarded tokens with GRPO-like
groups (``group_size`` completions of one prompt), so every rank does the same work. Timed: packing of the rows
not packed ahead (a single process's rows after its first), forward+backward, metric reduction and the optimizer
step, between two ``torch.cuda.synchronize`` calls (``opt s``: the optimizer's GPU time within the step, CUDA
events); row generation and the scatter are not (``asyncgrpo bench trainer-overhead`` measures planning).

Precision (``precision``): ``mixed`` (default, what a run uses: model.dtype=float32 master weights,
trainer.mixed_precision=bfloat16, FSDP2 also on one GPU), ``bf16`` (bf16 weights and AdamW state, no master
copy), ``fp32``.
"""

from __future__ import annotations

import gc
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncgrpo_cli.bench.rows import MIN_COMPLETION, RowPlan, synthetic_row
from asyncgrpo_cli.bench.shapes import PEAK_BF16_TFLOPS, SHAPES, weightless_checkpoint
from asyncgrpo_cli.bench.trainer_report import (
    FLOP_FORMULA,
    add_efficiency,
    footer,
    load_baseline,
    preamble,
    table_row,
)
from asyncgrpo_cli.errors import UserError

PRECISIONS = {"mixed": ("float32", "bfloat16"), "bf16": ("bfloat16", None), "fp32": ("float32", None)}
"""precision -> (model.dtype, trainer.mixed_precision)."""


@dataclass
class TrainerBenchConfig:
    shapes: str = "0.6b,1.7b"
    """Comma-separated model shapes: 0.6b, 1.7b (Qwen3), qwen3.5-2b (hybrid), tiny, tiny-qwen3.5 (CPU smoke tests)."""
    device: str = "auto"
    token_budget: int = 16384
    grad_accum: int = 1
    steps: int = 5
    warmup: int = 2
    precision: str = "mixed"
    gradient_checkpointing: bool = True
    compile: bool = False
    reshard_after_forward: bool = True
    one_rank_cast: str = "foreach"
    """trainer.one_rank_cast: foreach (one cast per layer on one rank, a run's default) or torch (FSDP2's, one per
    parameter)."""
    packing: str | None = None
    """Packer (packing.kind); None: the project's default."""
    attn: str | None = None
    """model.attn_implementation; None: the project's default (auto: flex attention on CUDA)."""
    linear_attention_kernel: str = "auto"
    """model.linear_attention_kernel of hybrid shapes: auto (fla on CUDA when installed, else torch), torch, fla."""
    lm_head_kernel: str = "auto"
    """model.lm_head_kernel: auto (the fused Triton head on CUDA when Triton imports), torch (chunked), triton."""
    flex_options: str = "default"
    """model.flex_kernel_options: candidates of ``bench attention`` (``bench/attention.py`` KERNEL_OPTIONS), joined
    by ``+`` to merge them (e.g. a forward and a backward candidate: ``fwd_128x64_s4+bwd_64_w4``); ``default``: a
    run's (tuned for the GPU where measured), ``torch``: torch's own table (model.flex_tuned_options=false)."""
    loss: str = "score_centering"
    prompt_len: int = 512
    completion_len: int = 4096
    """Completions are drawn uniformly from [completion_len / 2, completion_len] tokens."""
    group_size: int = 8
    num_topk: int = 8
    peak_tflops: float = PEAK_BF16_TFLOPS
    """Dense bf16 peak per GPU (H100 / H200 SXM)."""
    seed: int = 0
    out: str | None = None
    baseline: str | None = None
    profile: int = 0
    """Steps recorded by torch.profiler after the timed ones (untimed): ``trainer.profile``'s summary (kernel time
    by kind, the top kernels) is printed under the shape's row; with ``out=``, traces go to OUT's stem + -profile/."""


def parse_args(argv: list[str]) -> TrainerBenchConfig:
    from asyncgrpo_cli.bench.args import parse_key_values

    cfg, errors = parse_key_values(TrainerBenchConfig, argv)
    if cfg is not None:
        errors += _range_errors(cfg)
    if errors:
        raise UserError("asyncgrpo bench trainer: " + "; ".join(errors))
    return cfg


def _range_errors(cfg: TrainerBenchConfig) -> list[str]:
    from asyncgrpo_cli.bench.attention import KERNEL_OPTIONS
    from asyncgrpo_cli.config.choices import OneRankCast, choice_of
    from asyncgrpo_cli.model.head import HEAD_KERNELS

    ONE_RANK_CASTS = choice_of(OneRankCast).values

    checks = [
        (
            all(s in SHAPES for s in cfg.shapes.split(",")),
            f"bench.shapes ({cfg.shapes}): pick from {', '.join(SHAPES)}",
        ),
        (
            cfg.precision in PRECISIONS,
            f"bench.precision ({cfg.precision}) must be one of {', '.join(PRECISIONS)}",
        ),
        (cfg.device in ("auto", "cuda", "cpu"), f"bench.device ({cfg.device}) must be auto, cuda or cpu"),
        (
            cfg.linear_attention_kernel in ("auto", "torch", "fla"),
            f"bench.linear_attention_kernel ({cfg.linear_attention_kernel}) must be auto, torch or fla",
        ),
        (
            cfg.lm_head_kernel in HEAD_KERNELS,
            f"bench.lm_head_kernel ({cfg.lm_head_kernel}) must be one of {', '.join(HEAD_KERNELS)}",
        ),
        (
            all(n in KERNEL_OPTIONS for n in cfg.flex_options.split("+")),
            f"bench.flex_options ({cfg.flex_options}): names among {', '.join(KERNEL_OPTIONS)}, joined by +",
        ),
        (
            cfg.one_rank_cast in ONE_RANK_CASTS,
            f"bench.one_rank_cast ({cfg.one_rank_cast}) must be torch or foreach",
        ),
        (cfg.steps >= 1 and cfg.warmup >= 0 and cfg.grad_accum >= 1, "bench.steps / grad_accum must be >= 1"),
        (cfg.profile >= 0, f"bench.profile ({cfg.profile}) must be >= 0"),
        (
            cfg.token_budget >= cfg.prompt_len + MIN_COMPLETION,
            f"bench.token_budget ({cfg.token_budget}) must hold one sample: >= prompt_len + {MIN_COMPLETION}",
        ),
        (cfg.prompt_len >= 1, "bench.prompt_len must be >= 1 (the first token has nothing to predict it)"),
        (cfg.completion_len >= 2 * MIN_COMPLETION, f"bench.completion_len must be >= {2 * MIN_COMPLETION}"),
        (cfg.group_size >= 1 and cfg.num_topk >= 0, "bench.group_size must be >= 1 and num_topk >= 0"),
    ]
    return [msg for ok, msg in checks if not ok]


def step_flops(flops: Any, plans: list[RowPlan]) -> dict[str, float]:
    """Model FLOPs of the rows in ``plans`` by term (``flops``: the model's ``train.flops.StepFlops``)."""
    return flops.terms(
        sum(r.forwarded for r in plans), sum(r.trained for r in plans), sum(r.attn_pairs for r in plans)
    )


# ---------------------------------------------------------------------------------------------------- one shape


@dataclass
class _Trainer:
    """What one shape's timed steps drive."""

    model: Any
    optimizer: Any
    scheduler: Any
    loss_fn: Any
    packer: Any
    shared_prompt: bool
    max_grad_norm: float
    flops: Any
    """The model's ``train.flops.StepFlops`` (N = its active body parameters)."""
    linear_kernel: str | None
    """The gated-DeltaNet kernel ``load_policy`` installed (fla or torch); None for a model without such layers."""


def build_trainer(shape: str, cfg: TrainerBenchConfig, info: Any, device: Any, root: Path) -> _Trainer:
    """The model as ``asyncgrpo train`` builds it (load_policy, compile, FSDP2), AdamW, the loss and the packer."""
    import torch

    from asyncgrpo_cli import registry
    from asyncgrpo_cli.config.schema import LossConfig, ModelConfig, PackingConfig, TrainerConfig
    from asyncgrpo_cli.model.gdn.layer import installed_kernel
    from asyncgrpo_cli.model.loading import load_policy
    from asyncgrpo_cli.train.compile import compile_decoder_layers
    from asyncgrpo_cli.train.distributed import shard_model
    from asyncgrpo_cli.train.flops import StepFlops
    from asyncgrpo_cli.train.optim import build_optimizer, build_scheduler

    dtype, mixed = PRECISIONS[cfg.precision]
    model_cfg = ModelConfig(
        name_or_path=shape,
        dtype=dtype,
        gradient_checkpointing=cfg.gradient_checkpointing,
        linear_attention_kernel=cfg.linear_attention_kernel,
    )
    if cfg.attn is not None:
        model_cfg.attn_implementation = cfg.attn
    if cfg.flex_options != "default":
        from asyncgrpo_cli.bench.attention import use_candidates

        use_candidates(model_cfg, cfg.flex_options)
    tcfg = TrainerConfig(
        mixed_precision=mixed,
        compile=cfg.compile,
        reshard_after_forward=cfg.reshard_after_forward,
        one_rank_cast=cfg.one_rank_cast,
    )
    torch.manual_seed(cfg.seed)
    model = load_policy(weightless_checkpoint(SHAPES[shape], root / shape), model_cfg, device)
    flops = StepFlops(model)
    if tcfg.compile:
        compile_decoder_layers(model)
    model = shard_model(
        model,
        info,
        device,
        tcfg.mixed_precision,
        tcfg.cpu_offload,
        tcfg.reshard_after_forward,
        tcfg.one_rank_cast,
    )
    optimizer = build_optimizer(model, tcfg)
    packing = PackingConfig(token_budget=cfg.token_budget, **({"kind": cfg.packing} if cfg.packing else {}))
    return _Trainer(
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, tcfg),
        loss_fn=registry.resolve("loss", cfg.loss)(LossConfig(name=cfg.loss)),
        packer=registry.resolve("packer", packing.kind)(packing),
        shared_prompt=packing.kind == "tree",
        max_grad_norm=tcfg.max_grad_norm,
        flops=flops,
        linear_kernel=installed_kernel(model),
    )


def _sync_time(device: Any) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed_steps(
    t: _Trainer, cfg: TrainerBenchConfig, info: Any, device: Any, profiler: Any = None
) -> tuple[list, list, float]:
    """Warm-up then timed optimizer steps: (step seconds, optimizer seconds) per timed step on this rank, and the
    model FLOPs of the timed steps (rank 0; every rank's rows). With ``profiler`` (a
    ``train/profiler.StepProfiler`` of the ``cfg.profile`` steps after the timed ones), those steps run too."""
    from asyncgrpo_cli.train.distributed import RankStep, rank_steps, reduce_raw_metrics, scatter_step
    from asyncgrpo_cli.train.losses import merge_metric_parts
    from asyncgrpo_cli.train.step import OptimizerStep, forward_backward

    rng = np.random.default_rng(cfg.seed)
    config, planned = t.model.config, cfg.grad_accum * cfg.token_budget
    step_s, opt_s, flops = [], [], 0.0
    optimizer = OptimizerStep(t.model, t.optimizer, t.scheduler, t.max_grad_norm)
    timed_end = cfg.warmup + cfg.steps

    def plan_step() -> tuple[list[RankStep] | None, list[RowPlan]]:
        """Rank 0 plans every rank's rows, as the trainer does (other ranks: nothing)."""
        if not info.is_main:
            return None, []
        plans = [
            [
                synthetic_row(rng, cfg, config.vocab_size, t.shared_prompt, first_group=cfg.token_budget * i)
                for i in range(r * cfg.grad_accum, (r + 1) * cfg.grad_accum)
            ]
            for r in range(info.world_size)
        ]
        trained = sum(p.trained for rank in plans for p in rank)
        rows = [[p.samples for p in rank] for rank in plans]
        per_rank = rank_steps(rows, trained, t.packer.pack if info.enabled else None)
        return per_rank, [p for rank in plans for p in rank]

    upcoming, ahead = plan_step(), {}
    for step in range(timed_end + cfg.profile):  # the profiled steps: ``profiler`` is set iff cfg.profile
        if profiler is not None:
            profiler.before(step + 1)
        (per_rank, plans), upcoming = upcoming, plan_step()  # the next step's rows: untimed
        if cfg.warmup <= step < timed_end:
            flops += step_flops(t.flops, plans)["total"] if plans else 0.0
        mine = scatter_step(per_rank, info)
        first_row, overlap = ahead.pop("row", None), None
        if not info.enabled:  # one process: the next step's first row is packed under this step's GPU work

            def overlap(samples: list = upcoming[0][0].rows[0]) -> None:
                ahead["row"] = t.packer.pack(samples)

        t0 = _sync_time(device)
        res = forward_backward(
            t.model,
            mine.rows,
            mine.num_trained,
            t.packer,
            t.loss_fn,
            device,
            1.0,
            info.world_size,
            head_kernel=cfg.lm_head_kernel,
            overlap=overlap,
            first_row=first_row,
            optimizer=optimizer,
        )
        reduce_raw_metrics(merge_metric_parts(res.raw_parts), info)
        t1 = _sync_time(device)
        if not math.isfinite(res.loss):
            raise RuntimeError(f"bench trainer: step {step} gave a non-finite loss ({res.loss})")
        if res.forwarded != planned:  # the FLOP count assumes exactly full rows
            raise RuntimeError(f"bench trainer: rows forwarded {res.forwarded} tokens, planned {planned}")
        if cfg.warmup <= step < timed_end:
            step_s.append(t1 - t0)
            opt_s.append(res.optimizer_s)
        if profiler is not None:
            profiler.after(step + 1)
    if profiler is not None:
        profiler.close()
    return step_s, opt_s, flops


def _profiler(shape: str, cfg: TrainerBenchConfig, info: Any, device: Any, root: Path) -> Any:
    """The ``StepProfiler`` of the ``cfg.profile`` steps after the timed ones (None without ``profile=``)."""
    if not cfg.profile:
        return None
    from asyncgrpo_cli.config.schema import ProfileConfig
    from asyncgrpo_cli.train.profiler import StepProfiler

    first = cfg.warmup + cfg.steps + 1
    out = Path(cfg.out).with_suffix("").as_posix() + "-profile" if cfg.out else root / "profile"
    steps = list(range(first, first + cfg.profile))
    return StepProfiler(ProfileConfig(steps=steps, top=20), Path(out) / shape, info.rank, device)


def bench_shape(shape: str, cfg: TrainerBenchConfig, info: Any, device: Any, root: Path) -> dict[str, Any]:
    import torch

    from asyncgrpo_cli.model import fused_head
    from asyncgrpo_cli.model.flex import FLEX_IMPLS, active_backend

    t = build_trainer(shape, cfg, info, device, root)
    config, attn = t.model.config, t.model.config._attn_implementation
    kernels = active_backend() if attn in FLEX_IMPLS else None  # model.flex_backend as the loader resolved it
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    profiler = _profiler(shape, cfg, info, device, root)
    step_times, opt_s, flops = timed_steps(t, cfg, info, device, profiler)
    n = cfg.steps
    worst = _max_over_ranks(
        step_times + opt_s + [_peak_gib(device, "allocated"), _peak_gib(device, "reserved")],
        info,
        device,
    )
    step_s, opt_max, peak = worst[:n], worst[n : 2 * n], worst[2 * n :]
    body_params, total_params, kernel = t.flops.body, t.flops.total_body, t.linear_kernel
    del t  # free the model and optimizer before the next shape
    _release(device, cfg.compile)
    mean_step = float(np.mean(step_s))
    tokens = info.world_size * cfg.grad_accum * cfg.token_budget
    tflops = flops / sum(step_s) / info.world_size / 1e12
    return {
        "shape": shape,
        "body_params": body_params,
        "total_body_params": total_params,
        "linear_attention_kernel": kernel,
        "lm_head_kernel": fused_head.head_that_runs(cfg.lm_head_kernel, device),
        "world_size": info.world_size,
        "attn_implementation": attn,
        "flex_options": cfg.flex_options if attn in FLEX_IMPLS else "default",
        "flex_kernels": kernels,
        "profile_summary": profiler.summaries[0] if profiler is not None and profiler.summaries else None,
        "tokens_per_step": tokens,
        "step_s": mean_step,
        "step_s_min": float(np.min(step_s)),
        "step_s_max": float(np.max(step_s)),
        "optimizer_s": float(np.mean(opt_max)),
        "tokens_per_s": tokens / mean_step,
        "tokens_per_s_per_gpu": tokens / mean_step / info.world_size,
        "model_tflops_per_gpu": tflops,
        "mfu": tflops / cfg.peak_tflops if device.type == "cuda" else None,
        "peak_allocated_gib": peak[0],
        "peak_reserved_gib": peak[1],
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
    }


def _peak_gib(device: Any, kind: str) -> float:
    import torch

    if device.type != "cuda":
        return 0.0
    fn = torch.cuda.max_memory_allocated if kind == "allocated" else torch.cuda.max_memory_reserved
    return fn(device) / 2**30


def _max_over_ranks(values: list[float], info: Any, device: Any) -> list[float]:
    import torch

    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def _release(device: Any, compiled: bool) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if compiled:
        torch._dynamo.reset()


def main(argv: list[str]) -> None:
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    from asyncgrpo_cli.config.schema import PackingConfig, TrainerConfig
    from asyncgrpo_cli.train.distributed import destroy_distributed, init_distributed
    from asyncgrpo_cli.train.run import pick_device

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    cfg = parse_args(argv)
    baseline, differs = load_baseline(cfg.baseline, cfg) if cfg.baseline else ({}, [])
    hf_logging.set_verbosity_error()  # the weightless checkpoint's "newly initialized" report
    hf_logging.disable_progress_bar()
    device = pick_device(cfg.device)
    info = init_distributed(device, TrainerConfig().dist_timeout)
    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "world_size": info.world_size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "packing": cfg.packing or PackingConfig().kind,
        "baseline_differs": differs,
    }
    results: list[dict[str, Any]] = []
    try:
        if info.is_main:
            print(preamble(cfg, env), flush=True)
        with tempfile.TemporaryDirectory(prefix="asyncgrpo-bench-") as tmp:
            for shape in cfg.shapes.split(","):  # each row is printed and saved as soon as it is measured
                result = bench_shape(shape, cfg, info, device, Path(tmp))
                if not info.is_main:
                    continue
                add_efficiency(result, baseline)
                results.append(result)
                print(table_row(result), flush=True)
                if result["profile_summary"]:
                    print("\n" + result["profile_summary"], flush=True)
                if result["mfu"] is not None and result["step_s_max"] > 1.3 * result["step_s_min"]:
                    print(
                        f"  note: timed steps took {result['step_s_min']:.3f}-{result['step_s_max']:.3f} s: "
                        "something compiled or synchronized inside them; raise warmup= or steps=",
                        flush=True,
                    )
                if cfg.out:
                    doc = {
                        "config": asdict(cfg),
                        "env": env,
                        "flop_formula": FLOP_FORMULA,
                        "results": results,
                    }
                    Path(cfg.out).write_text(json.dumps(doc, indent=2))
        if info.is_main:
            print(footer(cfg, env), flush=True)
    finally:
        destroy_distributed()
