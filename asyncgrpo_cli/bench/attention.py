"""``asyncgrpo bench attention``: flex attention on the BlockMasks of packed rows, torch's default Triton kernel
options against candidate ``kernel_options``, side by side (no model; the attention of one layer).

Workload: one row per token budget, built as ``bench trainer`` builds its rows (``bench/rows.py``: GRPO groups
filling exactly ``token_budget`` forwarded tokens), packed by ``packing`` (tree: shared prompts; sequence), its
``BlockMask`` built as a training step builds it (``model/flex.py``: padded to the compiled length). Random q / k
/ v in bf16 with the shape's heads ([1, Hq, T, D] and [1, Hkv, T, D], GQA) and a random output gradient.

Each candidate of ``options`` (:data:`KERNEL_OPTIONS`; ``default`` is what a run uses: ``model/flex.py``'s tuned
options for the GPU and head dim where it has them, else torch's own table, which is ``torch``) is compiled on its
own (``torch.compile(flex_attention, dynamic=False)`` after a dynamo reset, so no recompile limit is reached) and
timed: median forward and forward+backward milliseconds over ``repeats`` after ``warmup`` calls, the first call's
seconds (compilation), and the largest |difference| of its output and q gradient from ``default``'s (the kernels
differ only in their reduction order); speedups are ``default``'s time over the candidate's (above 1: faster).
``autotune=true`` adds a ``mode=max-autotune-no-cudagraphs`` compile (Inductor benchmarks its own list of
configurations; minutes per shape). A candidate torch refuses (an option this torch does not know, a block size
that does not divide the mask's) is reported with its error and the rest go on.

On CPU (``device=cpu``, a smoke test of the rows and masks) only ``default`` runs, eager and forward only: flex
attention has no CPU backward and the options are Triton's.

Usage: asyncgrpo bench attention [shapes=0.6b] [token_budget=16384,65536] [packing=tree] [options=all]
       [autotune=false] [repeats=10] [warmup=3] [device=auto] [prompt_len=512] [completion_len=4096]
       [group_size=8] [seed=0] [out=PATH]
``shapes``: the attention heads of a ``bench trainer`` shape (0.6b and 1.7b share 16 query / 8 KV heads of 128).
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.model.flex_backend import FLASH_OPTIONS

KERNEL_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},  # what a run uses (model.flex_backend=auto): FlashAttention-4 where it runs, else as triton
    "triton": {},  # model.flex_backend=triton: model/flex.py's tuned options for the GPU and head dim, else torch's
    "torch": {},  # torch's own table (model.flex_tuned_options=false)
    "fwd_128x128_s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8},
    "fwd_128x64_s4": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 4, "fwd_num_warps": 8},
    "fwd_64x64_w4": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4},
    "tma": {"USE_TMA": True},
    "bwd_64_w4": {
        **{f"bwd_{k}": 64 for k in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")},
        "bwd_num_stages": 3,
        "bwd_num_warps": 4,
    },
    "bwd_32x128": {
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 3,
        "bwd_num_warps": 8,
    },
    "bwd_64x128_s2": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 2,
        "bwd_num_warps": 8,
    },
    "flash": FLASH_OPTIONS,
}
"""Candidate ``flex_attention(kernel_options=...)``: ``fwd_`` / ``bwd_`` keys reach only that pass's kernel. For
bf16 and head dim 128 on Hopper torch picks BLOCK_M/N 128/64, 3 stages, 8 warps forward and 64/128/128/64, 3
stages, 8 warps backward; the candidates move one of those at a time. ``flash``: torch's FlashAttention-4 backend
of flex (``model.flex_backend=flash``: CuTe DSL kernels; needs the ``flash-attn-4`` package, else it is reported
refused)."""


def candidate_options(name: str, q: Any, kv_heads: int) -> dict[str, Any] | None:
    """The ``kernel_options`` candidate ``name`` passes for q [B, H, L, D] over ``kv_heads`` key / value heads
    (``None``: torch's table): ``default`` and ``triton`` as a run's flex calls get them with model.flex_backend
    auto or triton (the loader's choice, ``model/flex_backend.py`` ``backend_for``, then ``model/flex.py``
    ``call_options``)."""
    from asyncgrpo_cli.model import flex
    from asyncgrpo_cli.model.flex_backend import backend_for

    if name not in ("default", "triton"):
        return KERNEL_OPTIONS.get(name) or None
    choice = "auto" if name == "default" else "triton"
    backend = backend_for(choice, q.device, q.shape[1], kv_heads, q.shape[-1], triton_tiles=False)
    flex.set_kernel_options({}, q.device if q.is_cuda else None, flash=backend == "flash")
    try:
        return flex.call_options(q)
    finally:
        flex.set_kernel_options({})


def merged_options(names: str) -> dict[str, Any]:
    """The kernel options of ``KERNEL_OPTIONS`` names joined by ``+`` (later names win a shared key)."""
    return {k: v for name in names.split("+") for k, v in KERNEL_OPTIONS[name].items()}


def use_candidates(model_cfg: Any, names: str) -> None:
    """Set a ``ModelConfig``'s flex options to the candidates ``names`` (``bench trainer flex_options=``):
    ``flash`` among them sets model.flex_backend=flash, any other triton (``default`` alone keeps auto);
    ``torch`` turns ``model.flex_tuned_options`` off."""
    listed = names.split("+")
    model_cfg.flex_backend = "flash" if "flash" in listed else "auto" if listed == ["default"] else "triton"
    model_cfg.flex_kernel_options = {k: v for k, v in merged_options(names).items() if k not in FLASH_OPTIONS}
    model_cfg.flex_tuned_options = "torch" not in listed


@dataclass
class AttentionBenchConfig:
    shapes: str = "0.6b"
    token_budget: list[int] = field(default_factory=lambda: [16384, 65536])
    """Forwarded tokens per row (comma-separated), one row each."""
    packing: str = "tree"
    options: list[str] = field(default_factory=lambda: ["all"])
    """Names of KERNEL_OPTIONS (comma-separated), or all (``default`` always runs: it is the reference)."""
    autotune: bool = False
    repeats: int = 10
    warmup: int = 3
    device: str = "auto"
    prompt_len: int = 512
    completion_len: int = 4096
    group_size: int = 8
    num_topk: int = 0
    seed: int = 0
    out: str | None = None


@dataclass
class _RowSpec:
    """One row's ``bench/rows.py`` spec (a single token budget of the config)."""

    token_budget: int
    prompt_len: int
    completion_len: int
    group_size: int
    num_topk: int


def parse_args(argv: list[str]) -> AttentionBenchConfig:
    from asyncgrpo_cli.bench.args import parse_key_values
    from asyncgrpo_cli.bench.rows import MIN_COMPLETION
    from asyncgrpo_cli.bench.shapes import SHAPES

    cfg, errors = parse_key_values(AttentionBenchConfig, argv)
    if cfg is not None:
        unknown = [n for n in _names(cfg.options) if n not in KERNEL_OPTIONS]
        checks = [
            (all(s in SHAPES for s in cfg.shapes.split(",")), f"bench.shapes: pick from {', '.join(SHAPES)}"),
            (not unknown, f"bench.options {unknown}: pick from all, {', '.join(KERNEL_OPTIONS)}"),
            (cfg.packing in ("tree", "sequence"), f"bench.packing ({cfg.packing}) must be tree or sequence"),
            (cfg.device in ("auto", "cuda", "cpu"), f"bench.device ({cfg.device}) must be auto, cuda or cpu"),
            (cfg.repeats >= 1 and cfg.warmup >= 0, "bench.repeats must be >= 1 and warmup >= 0"),
            (
                bool(cfg.token_budget)
                and all(b >= cfg.prompt_len + MIN_COMPLETION for b in cfg.token_budget),
                f"bench.token_budget ({cfg.token_budget}): integers >= prompt_len + {MIN_COMPLETION}",
            ),
            (cfg.prompt_len >= 1 and cfg.group_size >= 1, "bench.prompt_len and group_size must be >= 1"),
            (
                cfg.completion_len >= 2 * MIN_COMPLETION,
                f"bench.completion_len must be >= {2 * MIN_COMPLETION}",
            ),
        ]
        errors += [msg for ok, msg in checks if not ok]
    if errors:
        raise UserError("asyncgrpo bench attention: " + "; ".join(errors))
    return cfg


def _names(options: list[str]) -> list[str]:
    names = list(KERNEL_OPTIONS) if "all" in options else options
    return ["default"] + [n for n in names if n != "default"]


def packed_mask(
    cfg: AttentionBenchConfig, budget: int, vocab: int, device: Any
) -> tuple[Any, dict[str, Any]]:
    """The BlockMask of one synthetic row of ``budget`` forwarded tokens, and the row's counts."""
    import numpy as np

    from asyncgrpo_cli import registry
    from asyncgrpo_cli.bench.rows import synthetic_row
    from asyncgrpo_cli.config.schema import PackingConfig
    from asyncgrpo_cli.model.flex import FLEX_IMPL, row_block_mask

    spec = _RowSpec(budget, cfg.prompt_len, cfg.completion_len, cfg.group_size, cfg.num_topk)
    plan = synthetic_row(np.random.default_rng(cfg.seed), spec, vocab, cfg.packing == "tree", 0)
    row = registry.resolve("packer", cfg.packing)(PackingConfig(token_budget=budget, kind=cfg.packing)).pack(
        plan.samples
    )
    mask = row_block_mask(row.leave.to(device), FLEX_IMPL)
    blocks = mask.kv_num_blocks.sum().item() + (
        0 if mask.full_kv_num_blocks is None else mask.full_kv_num_blocks.sum().item()
    )
    n_blocks = mask.kv_num_blocks.shape[-1]
    return mask, {
        "forwarded": row.num_forwarded,
        "samples": row.num_samples,
        "attn_pairs": plan.attn_pairs,
        "padded_length": mask.seq_lengths[0],
        "block_density": blocks / (n_blocks * n_blocks),
    }


def _median_ms(fn: Any, warmup: int, repeats: int, sync: Any) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(
    name: str, mask: Any, q: Any, k: Any, v: Any, grad: Any, cfg: AttentionBenchConfig, reference: Any
) -> tuple[dict[str, Any], Any]:
    """One candidate on one row: its timings and differences from ``reference`` (output, dq), and its own."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    cuda = q.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch._dynamo.reset()
    if not cuda:
        # the CPU smoke test: eager flex, which warns that it materializes the scores (known; small rows)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        attend = flex_attention
    elif name == "autotune":
        attend = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
    else:
        attend = torch.compile(flex_attention, dynamic=False)
    options = candidate_options(name, q, k.shape[1])

    def forward() -> Any:
        return attend(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options)

    def forward_backward() -> None:
        q.grad = None
        forward().backward(grad)

    out: dict[str, Any] = {"options": name}
    try:
        t0 = time.perf_counter()
        if cuda:
            forward_backward()
        with torch.no_grad():
            o = forward()
        sync()
        out["first_call_s"] = time.perf_counter() - t0
        mine = (o.float(), q.grad.float() if cuda else None)
        with torch.no_grad():
            out["forward_ms"] = _median_ms(forward, cfg.warmup, cfg.repeats, sync)
        out["forward_backward_ms"] = (
            _median_ms(forward_backward, cfg.warmup, cfg.repeats, sync) if cuda else None
        )
    except Exception as e:  # a refused option: reported, the other candidates go on
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return out, None
    finally:
        q.grad = None
    if reference is not None:
        out["max_out_diff"] = (mine[0] - reference[0]).abs().max().item()
        out["max_dq_diff"] = None if mine[1] is None else (mine[1] - reference[1]).abs().max().item()
    return out, mine


def bench_row(shape: str, budget: int, cfg: AttentionBenchConfig, device: Any) -> list[dict[str, Any]]:
    import torch

    from asyncgrpo_cli.bench.shapes import SHAPES

    geometry = SHAPES[shape]
    hq, hkv, d = geometry["num_attention_heads"], geometry["num_key_value_heads"], geometry["head_dim"]
    mask, row = packed_mask(cfg, budget, geometry["vocab_size"], device)
    n = row["padded_length"]
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def rand(heads: int, grad: bool) -> Any:
        x = torch.randn(1, heads, n, d, device=device, dtype=dtype, generator=gen)
        return x.requires_grad_(grad)

    trains = device.type == "cuda"  # flex attention has no CPU backward
    q, k, v, grad = rand(hq, trains), rand(hkv, trains), rand(hkv, trains), rand(hq, grad=False)
    names = _names(cfg.options) if device.type == "cuda" else ["default"]
    if cfg.autotune and device.type == "cuda":
        names.append("autotune")
    results, reference = [], None
    for name in names:
        res, mine = measure(name, mask, q, k, v, grad, cfg, reference)
        reference = mine if name == "default" else reference
        base = results[0] if results else res
        for key in ("forward_ms", "forward_backward_ms"):
            ok = res.get(key) and base.get(key)
            res[f"{key.removesuffix('_ms')}_speedup"] = base[key] / res[key] if ok else None
        results.append({"shape": shape, "heads": f"{hq}/{hkv}x{d}", **row, **res})
    return results


def table_row(r: dict[str, Any]) -> str:
    def num(key: str, fmt: str) -> str:
        return "-" if r.get(key) is None else format(r[key], fmt)

    if "error" in r:
        return f"| {r['shape']} | {r['forwarded']} | {r['options']} | refused: {r['error']} |||||"
    return (
        f"| {r['shape']} | {r['forwarded']} | {r['options']} | {num('forward_ms', '.2f')} | "
        f"{num('forward_backward_ms', '.2f')} | {num('forward_backward_speedup', '.3f')} | "
        f"{num('max_out_diff', '.2e')} / {num('max_dq_diff', '.2e')} | {num('first_call_s', '.1f')} |"
    )


def main(argv: list[str]) -> None:
    import torch

    from asyncgrpo_cli.train.run import pick_device

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    cfg = parse_args(argv)
    device = pick_device(cfg.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"asyncgrpo bench attention on {name} (torch {torch.__version__}): packing={cfg.packing}, prompt_len="
        f"{cfg.prompt_len}, completion_len={cfg.completion_len}, group_size={cfg.group_size}, median of "
        f"{cfg.repeats} after {cfg.warmup} warm-up calls"
    )
    results: list[dict[str, Any]] = []
    for shape in cfg.shapes.split(","):
        for budget in cfg.token_budget:
            rows = bench_row(shape, budget, cfg, device)
            first = rows[0]
            print(
                f"\n{shape} ({first['heads']}), {first['forwarded']} tokens ({first['samples']} samples, padded to "
                f"{first['padded_length']}), {first['block_density']:.1%} of the mask's blocks attended\n"
                "| shape | tokens | options | fwd ms | fwd+bwd ms | fwd+bwd speedup | max diff out / dq | "
                "first call s |\n|---|---|---|---|---|---|---|---|"
            )
            for r in rows:
                print(table_row(r), flush=True)
            results += rows
            if cfg.out:
                doc = {"config": asdict(cfg), "device": name, "torch": torch.__version__, "results": results}
                Path(cfg.out).write_text(json.dumps(doc, indent=2))
            torch._dynamo.reset()
