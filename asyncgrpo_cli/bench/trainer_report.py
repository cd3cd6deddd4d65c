"""The report of ``asyncgrpo bench trainer``: its table, the FLOP formula it prints, and the comparison with a
baseline run's JSON (``baseline=``: scaling efficiency, flagged when the baseline ran other work). ``cfg`` is
``bench/trainer.py``'s ``TrainerBenchConfig`` (typed ``Any`` here: that module imports this one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncgrpo_cli.errors import UserError

FLOP_FORMULA = (
    "model FLOPs per step = 6·N·T + 6·V·H·T_head + 12·A·P + G·T (train/flops.py), where N = active parameters "
    "without the embedding / LM-head matrix (MoE: routed experts x top-k / experts), T = forwarded tokens, T_head = "
    "positions projected through the LM head (trained tokens; the chunked head projects no others), V·H = LM-head "
    "matrix, A = full-attention layers·heads·head_dim, P = attended (query, key) pairs, causal within each sample "
    "(Σ position+1; a shared prompt counted once under tree packing), G = gated-DeltaNet chunked recurrence FLOPs "
    "per token (hybrids; 0 otherwise). Recomputation (gradient checkpointing, the head's backward) is not counted. "
    "MFU = FLOPs / step time / (GPUs · peak_tflops)."
)


SAME_WORK = (
    "token_budget",
    "grad_accum",
    "precision",
    "gradient_checkpointing",
    "compile",
    "packing",
    "attn",
    "linear_attention_kernel",
    "lm_head_kernel",
    "flex_options",
    "loss",
    "prompt_len",
    "completion_len",
    "group_size",
    "num_topk",
)
"""Keys a baseline must share for its tokens/s to be comparable."""
LATER_KEYS = {"linear_attention_kernel": "auto", "lm_head_kernel": "torch", "flex_options": "default"}
"""Keys added after baselines were written, with the value those runs had."""


def load_baseline(path: str, cfg: Any) -> tuple[dict[str, dict], list[str]]:
    """The baseline's results by shape, and the keys in which its configuration differs from ``cfg``."""
    try:
        data = json.loads(Path(path).read_text())
        by_shape = {r["shape"]: r for r in data["results"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"bench.baseline={path!r} is not a JSON written by out= ({e})") from e
    recorded = {**LATER_KEYS, **data.get("config", {})}
    return by_shape, [k for k in SAME_WORK if recorded.get(k) != getattr(cfg, k)]


def add_efficiency(result: dict[str, Any], baseline: dict[str, dict]) -> None:
    """``scaling_efficiency`` = tokens/s per GPU over the baseline run's for the same shape (None without one)."""
    b = baseline.get(result["shape"])
    result["scaling_efficiency"] = result["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"] if b else None
    result["baseline_world_size"] = b["world_size"] if b else None


def preamble(cfg: Any, env: dict[str, Any]) -> str:
    return (
        f"asyncgrpo bench trainer on {env['world_size']} x {env['device']} (torch {env['torch']}, transformers "
        f"{env['transformers']}): precision={cfg.precision}, packing={env['packing']}, gradient_checkpointing="
        f"{cfg.gradient_checkpointing}, compile={cfg.compile}, reshard_after_forward={cfg.reshard_after_forward}, "
        f"one_rank_cast={cfg.one_rank_cast}, token_budget={cfg.token_budget}, grad_accum={cfg.grad_accum}, "
        f"{cfg.steps} timed steps after {cfg.warmup} warm-up\n"
        f"{'shape':>12} {'GPUs':>4} {'tok/step':>9} {'step s':>7} {'opt s':>6} {'tok/s':>9} {'tok/s/GPU':>9} "
        f"{'TFLOP/s/GPU':>11} {'MFU':>6} {'peak GiB':>8} {'eff':>6}  attention"
    )


def table_row(r: dict[str, Any]) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
    eff = r.get("scaling_efficiency")
    return (
        f"{r['shape']:>12} {r['world_size']:>4} {r['tokens_per_step']:>9} {r['step_s']:>7.3f} "
        f"{r['optimizer_s']:>6.3f} {r['tokens_per_s']:>9.0f} {r['tokens_per_s_per_gpu']:>9.0f} "
        f"{r['model_tflops_per_gpu']:>11.4g} {mfu:>6} {r['peak_allocated_gib']:>8.1f} "
        f"{f'{100 * eff:.0f}%' if eff is not None else '-':>6}  {r['attn_implementation']}"
        + (f" ({r['flex_options']})" if r.get("flex_options", "default") != "default" else "")
        + (f", {r['flex_kernels']} kernels" if r.get("flex_kernels") else "")
        + (f", LM head: {r['lm_head_kernel']}" if r.get("lm_head_kernel") else "")
        + (f", gated DeltaNet: {r['linear_attention_kernel']}" if r.get("linear_attention_kernel") else "")
    )


def footer(cfg: Any, env: dict[str, Any]) -> str:
    lines = [FLOP_FORMULA + f" peak_tflops={cfg.peak_tflops:g}. eff = tok/s/GPU over the baseline= run's."]
    if env["baseline_differs"]:
        lines.append(
            f"warning: the baseline ran different work ({', '.join(env['baseline_differs'])}): eff is not a "
            "scaling efficiency"
        )
    return "\n".join(lines)
