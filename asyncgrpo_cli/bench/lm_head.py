"""``asyncgrpo bench lm-head``: peak memory and time of forward+backward through the LM head, the naive dense head
(full [N, V] fp32 logits kept by autograd) against the chunked head (``model/chunked_head.py``) and, on CUDA with
Triton, the fused head (``model/fused_head.py``: ``model.lm_head_kernel=triton``), side by side.

Workload per shape (N positions, hidden size H, vocabulary V) and dtype: random h [N, H] and W [V, H] (both
require grad, as a tied or trained head does), random targets and K sampler top-k ids, objective
Σ_n w_n·logprob_n + Σ exp(topk log-probs) (gradients through both outputs), backward to h and W.

Peak memory is the largest number of bytes allocated above what was live before the forward (the inputs), so it
includes the gradients of h and W, which both heads produce:
  - CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``;
  - CPU: ``torch.profiler`` with ``profile_memory=True``; every allocation and free of torch's CPU allocator is
    replayed in order and the running total's maximum taken (allocations that oneDNN / MKL make outside torch's
    allocator, e.g. matmul scratch, are not counted).
Time is the median wall time of ``--repeats`` forward+backward passes after one warm-up (without the profiler).

Usage: asyncgrpo bench lm-head [--device auto|cpu|cuda] [--shapes NxHxV ...] [--dtypes fp32 bf16]
       [--repeats R] [--topk K] [--vocab-chunk C] [--position-chunk P] [--threads T]
Defaults: on CUDA N=8192, H in {1024, 2048}, V in {151936 (Qwen3), 49152}; on CPU N=2048, H=256, V=49152.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

CUDA_SHAPES = ["8192x1024x151936", "8192x2048x151936", "8192x1024x49152", "8192x2048x49152"]
CPU_SHAPES = ["2048x256x49152"]
MIB = 2**20


@dataclass
class Measurement:
    """One head on one shape: peak bytes above the inputs, median seconds, and its outputs (for the Δ column)."""

    peak_bytes: int | None
    seconds: float | None
    logprobs: object = None
    error: str = ""


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of torch CPU allocations live during ``fn()`` above those live before it.

    Replays the profiler's allocation events (``profile_memory=True``) in the order they happened.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def parse_shape(text: str) -> tuple[int, int, int]:
    """'NxHxV' -> (N, H, V)."""
    try:
        n, h, v = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: expected NxHxV (e.g. 8192x1024x151936), got {text!r}") from None
    return n, h, v


def _measure(run: Callable[[], object], device, repeats: int) -> Measurement:
    """Warm up once, measure the peak of one more pass, then time ``repeats`` passes."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        logprobs = run()
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            run()
            sync()
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            peak = cpu_peak_bytes(run)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            sync()
            times.append(time.perf_counter() - t0)
        return Measurement(peak, statistics.median(times), logprobs)
    except torch.OutOfMemoryError as exc:
        return Measurement(None, None, error=f"OOM ({str(exc).splitlines()[0][:60]})")


def bench_shape(
    n: int, h: int, v: int, dtype_name: str, device, args: argparse.Namespace
) -> tuple[Measurement, Measurement, Measurement | None]:
    """Naive, chunked and (where it runs) fused head on one shape / dtype."""
    import torch

    from asyncgrpo_cli.model.chunked_head import LogitTransform, chunked_token_stats, dense_token_stats
    from asyncgrpo_cli.model.head import token_stats

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    topk = torch.randint(0, v, (n, args.topk), generator=gen).to(device) if args.topk else None
    coef = torch.linspace(-1, 1, n, device=device)
    transform = LogitTransform(temperature=0.7)

    def runner(head: Callable[..., object], **kw) -> Callable[[], object]:
        def run():
            stats = head(hidden, weight, targets, transform=transform, candidate_ids=topk, **kw)
            loss = (coef * stats.logprobs).sum()
            if stats.candidate_logprobs is not None:
                loss = loss + stats.candidate_logprobs.exp().sum()
            loss.backward()
            hidden.grad = weight.grad = None
            return stats.logprobs.detach()

        return run

    naive = _measure(runner(dense_token_stats), device, args.repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    chunked = _measure(
        runner(chunked_token_stats, vocab_chunk=args.vocab_chunk, position_chunk=args.position_chunk),
        device,
        args.repeats,
    )
    fused = None
    if fused_reason(hidden) is None:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        fused = _measure(runner(token_stats, kernel="triton"), device, args.repeats)
    return naive, chunked, fused


def fused_reason(hidden) -> str | None:
    """Why the fused head is not measured on ``hidden``'s device (None: it is)."""
    from asyncgrpo_cli.model import fused_head

    return fused_head.unsupported(hidden)


def _fmt_mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MIB:,.0f}"


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f}"


def _delta(a: Measurement, b: Measurement | None) -> str:
    import torch

    if b is None or not isinstance(a.logprobs, torch.Tensor) or not isinstance(b.logprobs, torch.Tensor):
        return "-"
    return f"{(a.logprobs - b.logprobs).abs().max().item():.1e}"


def table_row(
    shape: tuple[int, int, int],
    dtype: str,
    naive: Measurement,
    chunked: Measurement,
    fused: Measurement | None = None,
) -> list[str]:
    """One markdown table row: shape, dtype, memory (naive, chunked, ratio), time (naive, chunked, ratio), Δ;
    then the fused head's peak, time, time against the chunked head and Δ ("-" where it did not run)."""
    n, h, v = shape
    mem_ratio = time_ratio = fused_ratio = "-"
    if naive.peak_bytes and chunked.peak_bytes:
        mem_ratio = f"{naive.peak_bytes / chunked.peak_bytes:.1f}x"
    if naive.seconds and chunked.seconds:
        time_ratio = f"{chunked.seconds / naive.seconds:.2f}"
    if fused is not None and fused.seconds and chunked.seconds:
        fused_ratio = f"{fused.seconds / chunked.seconds:.2f}"
    fused_peak = "-" if fused is None else (fused.error or _fmt_mib(fused.peak_bytes))
    return [
        f"{n} x {h} x {v}",
        dtype,
        f"{n * v * 4 / MIB:,.0f}",
        _fmt_mib(naive.peak_bytes) if not naive.error else naive.error,
        _fmt_mib(chunked.peak_bytes) if not chunked.error else chunked.error,
        mem_ratio,
        _fmt_ms(naive.seconds),
        _fmt_ms(chunked.seconds),
        time_ratio,
        _delta(naive, chunked),
        fused_peak,
        "-" if fused is None else _fmt_ms(fused.seconds),
        fused_ratio,
        _delta(naive, fused),
    ]


HEADER = [
    "N x H x V",
    "dtype",
    "[N,V] fp32 MiB",
    "naive peak MiB",
    "chunked peak MiB",
    "memory naive/chunked",
    "naive ms",
    "chunked ms",
    "time chunked/naive",
    "max abs Δ logprob",
    "fused peak MiB",
    "fused ms",
    "time fused/chunked",
    "fused max abs Δ logprob",
]


def main(argv: list[str]) -> None:
    import torch

    from asyncgrpo_cli.model import chunked_head

    parser = argparse.ArgumentParser(prog="asyncgrpo bench lm-head")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--shapes", nargs="+", default=None, help="NxHxV (default: per device, see the doc)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--topk", type=int, default=8, help="sampler top-k ids per position (0: none)")
    parser.add_argument("--vocab-chunk", type=int, default=None, help="default: chunked_head.tile_shape")
    parser.add_argument("--position-chunk", type=int, default=None, help="default: chunked_head.tile_shape")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    device = torch.device("cuda" if use_cuda else "cpu")
    shapes = [parse_shape(s) for s in (args.shapes or (CUDA_SHAPES if use_cuda else CPU_SHAPES))]
    default_positions, default_vocab = chunked_head.tile_shape(device)
    args.position_chunk = args.position_chunk or default_positions
    args.vocab_chunk = args.vocab_chunk or default_vocab

    where = (
        torch.cuda.get_device_name(device) if use_cuda else f"CPU, {torch.get_num_threads()} torch threads"
    )
    method = (
        "torch.cuda.max_memory_allocated"
        if use_cuda
        else "torch.profiler(profile_memory=True) allocation replay"
    )
    print(
        f"LM head forward+backward on {where}, torch {torch.__version__}; chunks {args.position_chunk} positions "
        f"x {args.vocab_chunk} vocab; top-k {args.topk}; T=0.7; peak = bytes above the inputs ({method}); "
        f"time = median of {args.repeats}"
    )
    why_not = fused_reason(torch.empty(0, device=device))
    print(
        "fused head (model.lm_head_kernel=triton): "
        + ("measured" if why_not is None else f"not run: {why_not}")
    )
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for shape in shapes:
        for dtype in args.dtypes:
            naive, chunked, fused = bench_shape(*shape, dtype, device, args)
            print("| " + " | ".join(table_row(shape, dtype, naive, chunked, fused)) + " |", flush=True)
