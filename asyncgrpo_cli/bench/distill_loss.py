"""``asyncgrpo bench distill-loss``: time and peak memory of forward+backward through the JSD distillation loss
(``distill/loss.py``) with the chunked LM head against a naive full-logits head, side by side, per teacher top-k.

Workload per teacher top-k K (T positions, hidden size H, vocabulary V): random h [T, H] and W [V, H] (both require
grad, as a tied or trained head does), and per position a teacher's sparse distribution in the ``TeacherTopK``
layout: K distinct top-K ids with decreasing log-probs holding 50-99 % of the mass, plus the realized column (half
of the realized tokens are outside the top-K and fill it; the others sit at a random rank and leave it -1). Both
paths compute the student's log-probs of the K + 1 candidate ids at the teacher temperature and the same
``JSDLoss`` (``beta``, tail bucket on), normalized by T, then backward to h and W:
  - chunked: ``model/chunked_head.py:chunked_token_stats`` with ``candidate_ids`` (tiles; no [T, V] logits kept);
  - naive: ``dense_token_stats``: [T, V] fp32 logits, log_softmax, gather (autograd keeps them).
Peak memory and time are measured as ``asyncgrpo bench lm-head`` does (its helpers): bytes allocated above the
inputs, ``torch.cuda.max_memory_allocated`` on CUDA, on CPU torch's allocator events replayed from the profiler
(allocations oneDNN / MKL make outside it are not counted); time = median of ``repeats`` passes after a warm-up.
``|Δ loss|`` is the absolute difference of the two paths' losses (the same inputs, so it should be rounding only).

Usage: asyncgrpo bench distill-loss [tokens=T] [vocab=V] [hidden=H] [top_k=8,64] [beta=0.0]
       [teacher_temperature=1.0] [device=auto] [dtype=bf16|fp32] [repeats=3] [threads=0] [seed=0]
Defaults: on CUDA T=16384, V=151936 (Qwen3), H=1024 (Qwen3-0.6B), bf16; on CPU T=1024, V=32768, H=256, fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncgrpo_cli.bench.args import parse_key_values
from asyncgrpo_cli.bench.lm_head import MIB, Measurement, _fmt_mib, _fmt_ms, _measure
from asyncgrpo_cli.errors import UserError

CUDA_DEFAULTS = {"tokens": 16384, "vocab": 151936, "hidden": 1024, "dtype": "bf16"}
CPU_DEFAULTS = {"tokens": 1024, "vocab": 32768, "hidden": 256, "dtype": "fp32"}
DTYPES = ("fp32", "bf16")


@dataclass
class DistillLossBenchConfig:
    tokens: int | None = None
    """Positions T (default: per device, see the module doc)."""
    vocab: int | None = None
    hidden: int | None = None
    top_k: list[int] = field(default_factory=lambda: [8, 64])
    """Teacher top-k values, one table row each (comma-separated)."""
    beta: float = 0.0
    teacher_temperature: float = 1.0
    device: str = "auto"
    dtype: str | None = None
    """fp32 or bf16 (default: bf16 on CUDA, fp32 on CPU)."""
    repeats: int = 3
    threads: int = 0
    """torch CPU threads (0: torch's default)."""
    seed: int = 0


def parse_args(argv: list[str]) -> DistillLossBenchConfig:
    """``KEY=VALUE`` arguments (lists comma-separated) into the config; every problem reported at once."""
    cfg, errors = parse_key_values(DistillLossBenchConfig, argv)
    if cfg is not None:
        checks = [
            (cfg.device in ("auto", "cuda", "cpu"), f"bench.device ({cfg.device}) must be auto, cuda or cpu"),
            (cfg.dtype in (None, *DTYPES), f"bench.dtype ({cfg.dtype}) must be fp32 or bf16"),
            (bool(cfg.top_k) and all(k >= 1 for k in cfg.top_k), f"bench.top_k ({cfg.top_k}) must be >= 1"),
            (
                all((x or 1) >= 1 for x in (cfg.tokens, cfg.vocab, cfg.hidden)),
                "bench.tokens/vocab/hidden >= 1",
            ),
            (cfg.repeats >= 1, f"bench.repeats ({cfg.repeats}) must be >= 1"),
        ]
        errors += [message for ok, message in checks if not ok]
        if cfg.vocab is not None and cfg.vocab < 2 * (max(cfg.top_k) + 1):
            errors.append(f"bench.vocab ({cfg.vocab}) must be at least 2 x (largest top_k + 1)")
    if errors:
        raise UserError("asyncgrpo bench distill-loss: " + "; ".join(errors))
    return cfg


def teacher_topk(tokens: int, vocab: int, k: int, gen) -> tuple[Any, Any, Any]:
    """(targets [T], ids [T, K+1], log-probs [T, K+1]) of a random teacher in the ``TeacherTopK`` layout.

    Top-K ids are start + j·step (mod V) with step·K < V, so they are distinct and start + K·step is a further
    distinct id, the realized token outside the top-K.
    """
    import torch

    start = torch.randint(0, vocab, (tokens,), generator=gen)
    step = torch.randint(1, vocab // (k + 1) + 1, (tokens,), generator=gen)
    ids = (start[:, None] + torch.arange(k + 1)[None] * step[:, None]) % vocab
    scores = (torch.randn(tokens, k, generator=gen) * 2).sort(dim=1, descending=True).values
    mass = 0.5 + 0.49 * torch.rand(tokens, 1, generator=gen)
    top = torch.log_softmax(scores, dim=1) + mass.log()
    room = torch.minimum(top[:, -1:].exp(), 1 - mass)  # the realized token's p <= p_min and <= the rest
    realized = (room * (0.1 + 0.9 * torch.rand(tokens, 1, generator=gen))).log()
    lps = torch.cat([top, realized], dim=1)
    outside = torch.rand(tokens, generator=gen) < 0.5
    rank = torch.randint(0, k, (tokens,), generator=gen)
    targets = torch.where(outside, ids[:, k], ids.gather(1, rank[:, None]).squeeze(1))
    ids[~outside, k] = -1
    lps[~outside, k] = float("-inf")
    return targets, ids, lps


def loss_row(targets, ids, lps):
    """A ``PackedRow`` holding only what the loss reads: targets and the teacher extra (forward fields dummies)."""
    import torch

    from asyncgrpo_cli.packing.row import PackedRow
    from asyncgrpo_cli.samples import TEACHER_TOPK, TeacherTopK

    n, device = targets.shape[0], targets.device
    dummy = torch.zeros(1, 1, dtype=torch.long, device=device)
    extra = TeacherTopK(ids, lps, teacher=torch.zeros(n, dtype=torch.long, device=device))
    return PackedRow(
        input_ids=dummy,
        position_ids=dummy,
        leave=torch.ones(1, dtype=torch.long, device=device),
        pred_index=torch.zeros(n, dtype=torch.long, device=device),
        target_ids=targets,
        sampler_logprobs=torch.zeros(n, device=device),
        advantages=torch.zeros(n, device=device),
        sample_index=torch.zeros(n, dtype=torch.long, device=device),
        num_forwarded=1,
        num_trained=n,
        num_samples=1,
        num_unpacked=1,
        extras={TEACHER_TOPK: extra},
    )


def bench_top_k(cfg: DistillLossBenchConfig, k: int, device, dtype) -> tuple[Measurement, Measurement]:
    """Naive and chunked path at one teacher top-k."""
    import torch

    from asyncgrpo_cli.config.schema import LossConfig
    from asyncgrpo_cli.distill.loss import JSDLoss
    from asyncgrpo_cli.model.chunked_head import LogitTransform, chunked_token_stats, dense_token_stats
    from asyncgrpo_cli.model.logprobs import TokenStats

    t, h, v = cfg.tokens, cfg.hidden, cfg.vocab
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    hidden = torch.randn(t, h, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device, dtype).requires_grad_()
    row = loss_row(*(x.to(device) for x in teacher_topk(t, v, k, gen)))
    loss_fn = JSDLoss(LossConfig(name="jsd", beta=cfg.beta, teacher_temperature=cfg.teacher_temperature))
    transform = LogitTransform(temperature=cfg.teacher_temperature)
    candidates = row.candidate_ids

    def runner(head) -> Any:
        def run():
            stats = head(hidden, weight, row.target_ids, transform=transform, candidate_ids=candidates)
            loss, _ = loss_fn(TokenStats(stats.logprobs, stats.entropy, stats.candidate_logprobs), row, t)
            loss.backward()
            hidden.grad = weight.grad = None
            return loss.detach()

        return run

    naive = _measure(runner(dense_token_stats), device, cfg.repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    chunked = _measure(runner(chunked_token_stats), device, cfg.repeats)
    return naive, chunked


HEADER = [
    "top-k",
    "T x H x V",
    "dtype",
    "[T,V] fp32 MiB",
    "naive peak MiB",
    "chunked peak MiB",
    "memory naive/chunked",
    "naive ms",
    "chunked ms",
    "time chunked/naive",
    "loss (chunked)",
    "|Δ loss|",
]


def table_row(cfg: DistillLossBenchConfig, k: int, naive: Measurement, chunked: Measurement) -> list[str]:
    mem_ratio = time_ratio = loss = delta = "-"
    if naive.peak_bytes and chunked.peak_bytes:
        mem_ratio = f"{naive.peak_bytes / chunked.peak_bytes:.1f}x"
    if naive.seconds and chunked.seconds:
        time_ratio = f"{chunked.seconds / naive.seconds:.2f}"
    if chunked.logprobs is not None:
        loss = f"{float(chunked.logprobs):.4f}"
        if naive.logprobs is not None:
            delta = f"{abs(float(naive.logprobs) - float(chunked.logprobs)):.1e}"
    return [
        str(k),
        f"{cfg.tokens} x {cfg.hidden} x {cfg.vocab}",
        cfg.dtype or "",
        f"{cfg.tokens * cfg.vocab * 4 / MIB:,.0f}",
        naive.error or _fmt_mib(naive.peak_bytes),
        chunked.error or _fmt_mib(chunked.peak_bytes),
        mem_ratio,
        _fmt_ms(naive.seconds),
        _fmt_ms(chunked.seconds),
        time_ratio,
        loss,
        delta,
    ]


def main(argv: list[str]) -> None:
    import torch

    from asyncgrpo_cli.model import chunked_head

    cfg = parse_args(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise UserError("asyncgrpo bench distill-loss: device=cuda but no CUDA device is available")
    device = torch.device("cuda" if use_cuda else "cpu")
    for key, value in (CUDA_DEFAULTS if use_cuda else CPU_DEFAULTS).items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
    positions, vocab_chunk = chunked_head.tile_shape(device)
    where = (
        torch.cuda.get_device_name(device) if use_cuda else f"CPU, {torch.get_num_threads()} torch threads"
    )
    method = "torch.cuda.max_memory_allocated" if use_cuda else "torch.profiler allocation replay"
    print(
        f"JSD distillation loss forward+backward on {where}, torch {torch.__version__}; beta {cfg.beta}, "
        f"teacher_temperature {cfg.teacher_temperature}, tail bucket on; chunks {positions} positions x "
        f"{vocab_chunk} vocab; peak = bytes above the inputs ({method}); time = median of {cfg.repeats}"
    )
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for k in cfg.top_k:
        naive, chunked = bench_top_k(cfg, k, device, dtype)
        print("| " + " | ".join(table_row(cfg, k, naive, chunked)) + " |", flush=True)
