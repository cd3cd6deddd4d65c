"""``asyncgrpo bench packing``: sample tokens trained per second under tree vs sequence packing, side by side.

Workload: synthetic GRPO groups (G rollouts of one P-token prompt; completions of C tokens that fork at their first
token). A group forwards G (P + C) tokens under sequence packing and P - 1 + G (C + 1) under tree packing; P is
chosen so that the packing ratio (sample tokens / tree-forwarded tokens) hits each requested ratio. Every step
plans, packs and runs forward + backward over the same samples with each packer, through the trainer's own code:
the packer's planner (``packing.planner_for``) and ``train/step.py:forward_backward`` (packing, the attention
path of ``model.attn_implementation=auto``: compiled flex on CUDA, SDPA on CPU, the LM head of
``model.lm_head_kernel=auto`` (fused Triton kernels on CUDA, chunked on CPU), the default
score-centering loss with 8 sampler top-k ids), with gradient checkpointing. Models are Qwen3 shapes and Qwen3.5-2B's
gated-DeltaNet hybrid, written as a weightless checkpoint (config.json from a hand-written config, no tensors) and
loaded by the trainer's ``load_policy`` (random weights, bf16 on CUDA, fp32 on CPU; nothing is downloaded): hybrids
get the packed gated-DeltaNet forward with ``kernel`` (model.linear_attention_kernel) resolved for the device, and
the table's shape column names the kernel that ran (``qwen3.5-2b (GDN fla)``).

Reported per shape and ratio, tree and sequence side by side:
  - eff tok/s: sample tokens (Σ L over the samples) per second, the throughput that matters; tree / seq is its
    ratio (the same samples, so the inverse ratio of step times), next to the FLOP bound (model FLOPs of the
    sequence plan / of the tree plan: the speed-up if both ran at the same MFU);
  - MFU: model FLOPs of the forwarded tokens per second / 989 TFLOP/s (H100 / H200 dense bf16), with model FLOPs
    ``train/flops.py:StepFlops`` = 6 N T (N: active body parameters, T: forwarded tokens) + 6 H V N_trained (the
    chunked head projects only trained positions) + 12 full-attention layers x heads x head_dim x pairs (QKᵀ and
    AV, forward and backward, over the attended query-key pairs) + G T (hybrids: the gated-DeltaNet chunked
    recurrence per token); recomputation is not counted. eff MFU counts the sequence plan's FLOPs instead;
  - peak GiB: ``torch.cuda.max_memory_allocated`` over the timed steps;
  - plan+pack %: planning and packing (CPU time on the step's critical path) as a share of the step.
Warm-up steps (one compilation per row-length bucket) are excluded; every timed step ends with a synchronize.
Every group's prompt starts with a token of its own, so groups share nothing across groups (the ratio is the
groups' own).

Shared system prompt (``system_len=S`` > 0, instead of the ratios): ``groups`` groups of G rollouts whose prompts
are one S-token system prompt, common to every group, then ``question_len`` tokens of the group's own; C-token
completions forking at their first token. Run three ways on the same samples: tree (one trie per row, the
default: the system prompt forwarded once per row), tree per group (``packing.share_across_groups=false``: once
per group in the row) and sequence. Reported side by side: eff tok/s of each and their ratios to sequence, the
FLOP bound of each tree plan, the forwarded tokens per row (rows x mean), and how many times a row forwards the
system prompt (its tokens at depths < S - 1, over S - 1), e.g. the issue's 1k-token system prompt and 16 groups
of 16 x 256: ``system_len=1024 question_len=64 groups=16 group_size=16 completion_len=256``.

Usage: asyncgrpo bench packing [shapes=0.6b,1.7b] [ratios=1,2,3.4,8] [token_budget=16384] [rows=4] [steps=3]
       [warmup=1] [group_size=16] [completion_len=256] [device=auto] [kernel=auto] [threads=0] [out=results.json]
       [system_len=0] [question_len=64] [groups=16]
``rows``: tree rows per step (the number of groups follows); shapes: 0.6b, 1.7b, qwen3.5-2b, tiny, tiny-qwen3.5
(CUDA defaults: 0.6b,1.7b, budget 16384, C 256; CPU defaults: tiny, budget 512, C 16); ``kernel``: auto, torch or
fla for hybrids' gated-DeltaNet layers.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from asyncgrpo_cli.bench.shapes import PEAK_BF16_TFLOPS, QWEN3_5_SHAPES, QWEN3_SHAPES, weightless_checkpoint
from asyncgrpo_cli.errors import UserError

PEAK_FLOPS = PEAK_BF16_TFLOPS * 1e12
SHAPES = {
    **QWEN3_SHAPES,
    **QWEN3_5_SHAPES,
    "tiny": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=40960),
}  # fmt: skip
TOPK = 8


@dataclass
class Options:
    shapes: list[str] = field(default_factory=list)
    ratios: list[float] = field(default_factory=lambda: [1.0, 2.0, 3.4, 8.0])
    token_budget: int = 0
    rows: int = 4
    steps: int = 3
    warmup: int = 1
    group_size: int = 16
    completion_len: int = 0
    device: str = "auto"
    kernel: str = "auto"
    threads: int = 0
    out: str = ""
    system_len: int = 0
    question_len: int = 64
    groups: int = 16


def parse_options(argv: list[str]) -> Options:
    """``key=value`` arguments into :class:`Options` (lists comma-separated); unknown keys are refused."""
    opts = Options()
    types = {f.name: f for f in fields(Options)}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in types:
            raise UserError(
                f"asyncgrpo bench packing: expected KEY=VALUE with KEY in {', '.join(types)}, got {arg!r}"
            )
        default = getattr(opts, key)
        try:
            if isinstance(default, list):
                cast = float if key == "ratios" else str
                parsed: Any = [cast(x) for x in value.split(",") if x]
            else:
                parsed = type(default)(value)
        except ValueError:
            raise UserError(f"asyncgrpo bench packing: {key}={value!r} is not a valid {key}") from None
        setattr(opts, key, parsed)
    return opts


def prompt_len(ratio: float, group: int, completion: int) -> int:
    """P such that one group's G (P + C) / (P - 1 + G (C + 1)) is closest to ``ratio`` (P = 1 gives exactly 1)."""
    if not 1.0 <= ratio < group:
        raise UserError(f"asyncgrpo bench packing: ratio {ratio} needs 1 <= ratio < group_size ({group})")
    tree = group * (completion + 1) - 1
    return max(1, round((ratio * tree - group * completion) / (group - ratio)))


def workload(ratio: float, opts: Options, vocab: int) -> tuple[int, list]:
    """(P, samples): about ``opts.rows`` tree rows of groups whose *planned* packing ratio is closest to ``ratio``.

    A group that does not fit the rest of a row continues in the next one and forwards its prompt again, so the
    planned ratio falls below the one-group formula; P is bisected on the tree planner's own token counts.
    """
    from asyncgrpo_cli.packing.tree_planner import TreeBudgetPlanner

    g, c = opts.group_size, opts.completion_len

    def build(p: int) -> tuple[float, list]:
        groups = max(1, round(opts.rows * opts.token_budget / (p - 1 + g * (c + 1))))
        samples = make_samples(np.random.default_rng(0), groups, g, p, c, vocab)
        planner = TreeBudgetPlanner(opts.token_budget, num_ranks=1)
        batches = [mb for s in samples if (mb := planner.add(s)) is not None] + [planner.flush()]
        return sum(map(len, samples)) / sum(int(mb.tokens_per_row.sum()) for mb in batches), samples

    lo, hi = prompt_len(ratio, g, c), opts.token_budget - c
    if lo > hi:
        raise UserError(
            f"asyncgrpo bench packing: ratio {ratio} needs {lo}-token prompts, so samples of {lo + c} tokens exceed "
            f"token_budget={opts.token_budget}: raise token_budget or lower completion_len / raise group_size"
        )
    best = (abs(build(lo)[0] - ratio), lo)
    while lo < hi:  # smallest P whose planned ratio reaches the target (the ratio grows with P)
        mid = (lo + hi) // 2
        got = build(mid)[0]
        best = min(best, (abs(got - ratio), mid))
        lo, hi = (mid + 1, hi) if got < ratio else (lo, mid)
    best = min(best, (abs(build(lo)[0] - ratio), lo))
    return best[1], build(best[1])[1]


def make_samples(
    rng: np.random.Generator,
    groups: int,
    group: int,
    prompt: int,
    completion: int,
    vocab: int,
    system: np.ndarray | None = None,
):
    """``groups`` x ``group`` samples: a shared prompt, completions forking at distinct first tokens. Each group's
    ``prompt`` tokens start with a token no other group's do (up to ``vocab`` groups), after ``system`` if given
    (every group's prompt is then the system prompt and its own ``prompt`` tokens)."""
    from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK, TrainingSequence

    base = -float(np.log(vocab))  # a random model is near uniform: importance ratios near 1
    heads = rng.permutation(vocab)
    out = []
    for g in range(groups):
        head = rng.integers(0, vocab, size=prompt)
        head[0] = heads[g % vocab]
        if system is not None:
            head = np.concatenate([system, head])
        firsts = rng.choice(vocab, size=group, replace=False)
        for i in range(group):
            tail = rng.integers(0, vocab, size=completion)
            tail[0] = firsts[i]
            ids = np.concatenate([head, tail]).astype(np.int64)
            mask = np.zeros(ids.shape[0], dtype=bool)
            mask[head.shape[0] :] = True
            lps = np.where(mask, base + rng.normal(0, 0.2, ids.shape[0]), 0.0).astype(np.float32)
            out.append(TrainingSequence(
                input_ids=ids, train_mask=mask, sampler_logprobs=lps, advantage=float(rng.normal()),
                token_extras={SAMPLER_TOPK: TopK(
                    rng.integers(0, vocab, size=(completion, TOPK)),
                    (base + rng.normal(0, 0.2, (completion, TOPK))).astype(np.float32),
                )},
                group_id=g, prompt_seq=g, group_num_samples=group,
            ))  # fmt: skip
    return out


class RecordingPacker:
    """Wraps a packer: times ``pack`` and keeps the step's rows (for token, pair and FLOP counts)."""

    def __init__(self, packer: Any) -> None:
        self.packer, self.planner = packer, packer.planner
        self.seconds, self.rows = 0.0, []

    def pack(self, samples: Any) -> Any:
        t0 = time.perf_counter()
        row = self.packer.pack(samples)
        self.seconds += time.perf_counter() - t0
        self.rows.append(row)
        return row


def build_model(shape: str, device: Any, kernel: str = "auto") -> Any:
    """The shape with random weights as training loads it (``load_policy`` on a weightless checkpoint: attention
    resolved for ``device``, hybrids' packed gated-DeltaNet forward with ``kernel``, checkpointing on); bf16 on
    CUDA, fp32 elsewhere."""
    import tempfile
    from pathlib import Path

    import torch
    from transformers.utils import logging as hf_logging

    from asyncgrpo_cli.config.schema import ModelConfig
    from asyncgrpo_cli.model.loading import load_policy

    hf_logging.set_verbosity_error()  # the weightless checkpoint's "newly initialized" report
    hf_logging.disable_progress_bar()
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = ModelConfig(
        name_or_path=shape, dtype=dtype, gradient_checkpointing=True, linear_attention_kernel=kernel
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-bench-") as tmp:
        return load_policy(weightless_checkpoint(SHAPES[shape], Path(tmp) / shape), cfg, device)


def run_packer(kind: str, model: Any, samples: list, opts: Options, device: Any, share: bool = True) -> dict:
    """Warm-up and timed steps of one packer over ``samples`` (``share``: packing.share_across_groups); per-step
    medians and counts."""
    import torch

    from asyncgrpo_cli import registry
    from asyncgrpo_cli.config.schema import LossConfig, PackingConfig
    from asyncgrpo_cli.packing import planner_for
    from asyncgrpo_cli.train.flops import StepFlops
    from asyncgrpo_cli.train.step import forward_backward

    cuda = device.type == "cuda"
    loss_fn = registry.resolve("loss", "score_centering")(LossConfig())
    packer = RecordingPacker(
        registry.resolve("packer", kind)(PackingConfig(kind=kind, share_across_groups=share))
    )
    step_s, plan_pack_s = [], []
    for step in range(opts.warmup + opts.steps):
        if step == opts.warmup and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        packer.seconds, packer.rows = 0.0, []
        t0 = time.perf_counter()
        planner = planner_for(packer)(opts.token_budget, num_ranks=1)
        batches = [mb for s in samples if (mb := planner.add(s)) is not None]
        batches += [mb for mb in [planner.flush()] if mb is not None]
        t_plan = time.perf_counter() - t0
        forward_backward(model, [mb.rows[0] for mb in batches], sum(mb.num_trained for mb in batches), packer,
                         loss_fn, device, temperature=1.0)  # fmt: skip
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if step >= opts.warmup:
            step_s.append(time.perf_counter() - t0)
            plan_pack_s.append(t_plan + packer.seconds)
    rows = packer.rows
    pairs = sum(int((r.leave - torch.arange(r.num_forwarded)).sum()) for r in rows)
    forwarded, trained = sum(r.num_forwarded for r in rows), sum(r.num_trained for r in rows)
    t = statistics.median(step_s)
    shallow = opts.system_len - 1  # a shared system prompt's tokens below its last (0: none)
    return dict(
        forwarded_per_row=[r.num_forwarded for r in rows],
        system_copies_per_row=[int((r.position_ids < shallow).sum()) / shallow for r in rows] if shallow > 0 else None,
        rows=len(rows), forwarded_tokens=forwarded, sample_tokens=sum(r.num_unpacked for r in rows),
        trained_tokens=trained, attention_pairs=pairs, step_s=t, plan_pack_s=statistics.median(plan_pack_s),
        model_flops=StepFlops(model)(forwarded, trained, pairs),
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
    )  # fmt: skip


def bench_ratio(shape: str, ratio: float, model: Any, opts: Options, device: Any, vocab: int) -> dict:
    """One shape and ratio: the workload, both packers, and the derived throughputs."""
    from asyncgrpo_cli.model.gdn.layer import installed_kernel

    g, c = opts.group_size, opts.completion_len
    p, samples = workload(ratio, opts, vocab)
    groups = len(samples) // g
    res = {kind: run_packer(kind, model, samples, opts, device) for kind in ("tree", "sequence")}
    seq_flops = res["sequence"]["model_flops"]
    for r in res.values():
        r["effective_tok_s"] = r["sample_tokens"] / r["step_s"]
        r["forwarded_tok_s"] = r["forwarded_tokens"] / r["step_s"]
        r["trained_tok_s"] = r["trained_tokens"] / r["step_s"]
        r["mfu"] = r["model_flops"] / r["step_s"] / PEAK_FLOPS if device.type == "cuda" else None
        r["effective_mfu"] = seq_flops / r["step_s"] / PEAK_FLOPS if device.type == "cuda" else None
    tree, seq = res["tree"], res["sequence"]
    return dict(
        shape=shape, linear_attention_kernel=installed_kernel(model), ratio_target=ratio,
        ratio=tree["sample_tokens"] / tree["forwarded_tokens"], group_size=g,
        prompt_len=p, completion_len=c, groups=groups, samples=len(samples), token_budget=opts.token_budget,
        speedup=seq["step_s"] / tree["step_s"], flop_bound=seq_flops / tree["model_flops"], tree=tree, sequence=seq,
    )  # fmt: skip


def bench_system(shape: str, model: Any, opts: Options, device: Any, vocab: int) -> dict:
    """The shared-system-prompt workload: tree (one trie per row), tree per group and sequence side by side."""
    from asyncgrpo_cli.model.gdn.layer import installed_kernel

    g, c, q, k = opts.group_size, opts.completion_len, opts.question_len, opts.system_len
    rng = np.random.default_rng(0)
    samples = make_samples(rng, opts.groups, g, q, c, vocab, system=rng.integers(0, vocab, size=k))
    if k + q + c > opts.token_budget:
        raise UserError(
            f"asyncgrpo bench packing: samples of system_len + question_len + completion_len = {k + q + c} "
            f"tokens exceed token_budget={opts.token_budget}: raise token_budget or shorten them"
        )
    runs = {
        "tree": run_packer("tree", model, samples, opts, device, share=True),
        "tree_per_group": run_packer("tree", model, samples, opts, device, share=False),
        "sequence": run_packer("sequence", model, samples, opts, device),
    }
    seq_flops = runs["sequence"]["model_flops"]
    for r in runs.values():
        r["effective_tok_s"] = r["sample_tokens"] / r["step_s"]
        r["speedup"] = runs["sequence"]["step_s"] / r["step_s"]
        r["flop_bound"] = seq_flops / r["model_flops"]
        r["mfu"] = r["model_flops"] / r["step_s"] / PEAK_FLOPS if device.type == "cuda" else None
    return dict(
        shape=shape, linear_attention_kernel=installed_kernel(model), system_len=k, question_len=q,
        group_size=g, completion_len=c, groups=opts.groups, samples=len(samples), token_budget=opts.token_budget,
        **runs,
    )  # fmt: skip


SYSTEM_HEADER = ["shape", "groups x G x (S+Q+C)", "tree eff tok/s", "per-group eff tok/s", "seq eff tok/s",
                 "tree/seq", "per-group/seq", "FLOP bound", "per-group FLOP bound", "tok/row tree",
                 "tok/row per-group", "tok/row seq", "system per row: tree", "per-group", "tree MFU",
                 "tree plan+pack %"]  # fmt: skip


def system_row(r: dict) -> list[str]:
    def per_row(run: dict) -> str:
        rows = run["forwarded_per_row"]
        return f"{len(rows)} x {sum(rows) / len(rows):,.0f}"

    def copies(run: dict) -> str:
        c = run["system_copies_per_row"]
        return "-" if c is None else f"{sum(c) / len(c):.2f}"

    t, pg, s = r["tree"], r["tree_per_group"], r["sequence"]
    kernel = r.get("linear_attention_kernel")
    return [
        r["shape"] + (f" (GDN {kernel})" if kernel else ""),
        f"{r['groups']} x {r['group_size']} x ({r['system_len']}+{r['question_len']}+{r['completion_len']})",
        f"{t['effective_tok_s']:,.0f}", f"{pg['effective_tok_s']:,.0f}", f"{s['effective_tok_s']:,.0f}",
        f"{t['speedup']:.2f}x", f"{pg['speedup']:.2f}x", f"{t['flop_bound']:.2f}x", f"{pg['flop_bound']:.2f}x",
        per_row(t), per_row(pg), per_row(s), copies(t), copies(pg),
        "-" if t["mfu"] is None else f"{100 * t['mfu']:.1f}%", f"{100 * t['plan_pack_s'] / t['step_s']:.1f}%",
    ]  # fmt: skip


HEADER = ["shape", "ratio", "G x (P+C)", "tree eff tok/s", "seq eff tok/s", "tree/seq", "FLOP bound",
          "tree MFU", "seq MFU", "tree eff MFU", "tree peak GiB", "seq peak GiB", "tree plan+pack %",
          "seq plan+pack %"]  # fmt: skip


def table_row(r: dict) -> list[str]:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    def gib(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    t, s = r["tree"], r["sequence"]
    kernel = r.get("linear_attention_kernel")
    return [
        r["shape"] + (f" (GDN {kernel})" if kernel else ""), f"{r['ratio']:.2f}",
        f"{r['group_size']} x ({r['prompt_len']}+{r['completion_len']})",
        f"{t['effective_tok_s']:,.0f}", f"{s['effective_tok_s']:,.0f}", f"{r['speedup']:.2f}x",
        f"{r['flop_bound']:.2f}x", pct(t["mfu"]), pct(s["mfu"]), pct(t["effective_mfu"]), gib(t["peak_gib"]),
        gib(s["peak_gib"]), pct(t["plan_pack_s"] / t["step_s"]), pct(s["plan_pack_s"] / s["step_s"]),
    ]  # fmt: skip


def main(argv: list[str]) -> None:
    import torch

    opts = parse_options(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    use_cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise UserError("asyncgrpo bench packing: device=cuda but no CUDA device is available")
    device = torch.device("cuda" if use_cuda else "cpu")
    opts.shapes = opts.shapes or (["0.6b", "1.7b"] if use_cuda else ["tiny"])
    opts.token_budget = opts.token_budget or (16384 if use_cuda else 512)
    opts.completion_len = opts.completion_len or (256 if use_cuda else 16)
    unknown = sorted(set(opts.shapes) - set(SHAPES))
    if unknown:
        raise UserError(f"asyncgrpo bench packing: unknown shapes {unknown}; shapes: {', '.join(SHAPES)}")
    where = (
        torch.cuda.get_device_name(device) if use_cuda else f"CPU, {torch.get_num_threads()} torch threads"
    )
    if opts.system_len > 0 and (opts.groups < 1 or opts.question_len < 1):
        raise UserError("asyncgrpo bench packing: system_len > 0 needs groups >= 1 and question_len >= 1")
    workload = (
        f"a {opts.system_len}-token system prompt shared by {opts.groups} groups"
        if opts.system_len > 0
        else f"~{opts.rows} tree rows per step"
    )
    from asyncgrpo_cli.model.fused_head import head_that_runs

    head = "fused Triton LM head" if head_that_runs("auto", device) == "triton" else "chunked LM head"
    print(
        f"tree vs sequence packing, forward+backward ({head}, gradient checkpointing) on {where}, torch "
        f"{torch.__version__}; token_budget {opts.token_budget}, {workload}, median of "
        f"{opts.steps} steps after {opts.warmup} warm-up; MFU vs {PEAK_FLOPS / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    header = SYSTEM_HEADER if opts.system_len > 0 else HEADER
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)
    meta = dict(device=where, torch=torch.__version__, peak_flops=PEAK_FLOPS, options=asdict(opts))
    results = []
    for shape in opts.shapes:
        model = build_model(shape, device, opts.kernel)
        vocab = model.config.vocab_size
        for ratio in [None] if opts.system_len > 0 else opts.ratios:  # None: the system-prompt workload
            if ratio is None:
                results.append(bench_system(shape, model, opts, device, vocab))
                line = system_row(results[-1])
            else:
                results.append(bench_ratio(shape, ratio, model, opts, device, vocab))
                line = table_row(results[-1])
            print("| " + " | ".join(line) + " |", flush=True)
            if opts.out:  # after every row, so an interrupted run keeps what it measured
                with open(opts.out, "w") as f:
                    json.dump({"meta": meta, "results": results}, f, indent=1)
        del model
        if use_cuda:
            torch.cuda.empty_cache()
    if opts.out:
        print(f"wrote {opts.out}")
