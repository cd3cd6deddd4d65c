"""``asyncgrpo bench planning``: CPU cost of planning and packing one GRPO step, per sample (no model, no torch
compute): the trainer-side work between the rollout queue and the forward.

Workload (synthetic, seeded): ``samples`` samples in groups of ``group_size`` sharing one prompt. Prompt lengths
are uniform in [P/2, 3P/2]; completion lengths log-normal around C (sigma 0.6, at least 1 token); a third of the
completions restart from an earlier completion of their group for a random stretch (shared reasoning openings)
and one in 16 repeats an earlier one exactly, so tries fork below the prompt too. Every completion token is
trained, with sampler log-probs and a ``sampler_topk`` extra of width ``topk`` (the default loss's).
``system_len=S`` puts one S-token system prompt before every group's prompt (shared across groups: one trie per
row shares it, ``share=0`` runs the tree cases with one trie per group, ``packing.share_across_groups=false``).
``transport=batch`` (default) hands the planner the samples as the trainer's rollout reader does: each group
pickled as one ``SampleBatch`` and read back, so every sample's arrays are views of its group's columns, with
unpickled dtypes; ``transport=plain`` hands it the arrays as built. ``feed=group`` (default) hands the planner each
group's samples in one call, as the trainer does (``add_group``: the rest of a group again after a sample closed a
micro-batch); ``feed=sample`` one ``add`` a sample; ``feed=both`` alternates the two within this process
(A B B A ...) and prints a row for each.

For each packer (sequence, tree) and planner (its token-budget planner, and the fixed-count planner of
``packing.token_budget <= 0`` with ``samples / rows`` samples per row), one repeat plans the whole step
(every group or sample fed, then ``flush``) and packs every row of every micro-batch; one planner per case serves
every repeat, as the trainer's serves every step. Reported: the median over
``repeats`` of planning and of packing time, in microseconds per sample, plus the rows and forwarded tokens of the
plan. Defaults: 2,000 samples, P = C = 16, so Σ L is about 64k tokens, in rows of ``token_budget`` = 16,384.

Freed host memory: ``host_memory=keep`` (default) keeps it for reuse, as the trainer does
(``trainer.keep_host_memory``, ``host_memory.py``); ``return`` sets glibc's starting thresholds, so freed memory
goes back to the kernel and each row faults fresh pages in; ``both`` alternates the two within this process
(A B B A ...) and prints a row for each. Page faults per sample are counted over planning and packing.

Usage: asyncgrpo bench planning [samples=2000] [group_size=16] [prompt_len=16] [completion_len=16] [topk=8]
       [token_budget=16384] [ranks=1] [rows=4] [repeats=5] [seed=0] [profile=0] [system_len=0] [share=1]
       [host_memory=keep|return|both] [transport=batch|plain] [feed=group|sample|both]
``profile=N`` prints the N most expensive functions (cProfile, cumulative) of one repeat of each case, after a warm-up,
instead.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from asyncgrpo_cli.errors import UserError


@dataclass
class Options:
    samples: int = 2000
    group_size: int = 16
    prompt_len: int = 16
    completion_len: int = 16
    topk: int = 8
    token_budget: int = 16384
    ranks: int = 1
    rows: int = 4
    repeats: int = 5
    seed: int = 0
    profile: int = 0
    system_len: int = 0
    share: int = 1
    host_memory: str = "keep"
    transport: str = "batch"
    feed: str = "group"


CHOICES = {
    "host_memory": ("keep", "return", "both"),
    "transport": ("batch", "plain"),
    "feed": ("group", "sample", "both"),
}


def parse_options(argv: list[str]) -> Options:
    """``key=value`` arguments into :class:`Options` (integers, and the choices of ``CHOICES``); unknown keys and
    bad values name the key."""
    opts = Options()
    names = [f.name for f in fields(Options)]
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in names:
            raise UserError(
                f"asyncgrpo bench planning: expected KEY=VALUE with KEY in {', '.join(names)}, got {arg!r}"
            )
        if key in CHOICES:
            if value not in CHOICES[key]:
                raise UserError(
                    f"asyncgrpo bench planning: {key}={value!r}: one of {', '.join(CHOICES[key])}"
                )
            setattr(opts, key, value)
            continue
        try:
            setattr(opts, key, int(value))
        except ValueError:
            raise UserError(f"asyncgrpo bench planning: {key}={value!r} is not an integer") from None
    return opts


def make_step(opts: Options, vocab: int = 32000) -> list:
    """The synthetic step of the module docstring (``opts.samples`` samples, group after group)."""
    from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK, TrainingSequence

    rng = np.random.default_rng(opts.seed)
    g = max(1, opts.group_size)
    system = rng.integers(0, vocab, size=opts.system_len) if opts.system_len > 0 else None
    out = []
    for group in range(-(-opts.samples // g)):
        p = int(rng.integers(max(1, opts.prompt_len // 2), max(2, 3 * opts.prompt_len // 2 + 1)))
        prompt = rng.integers(0, vocab, size=p)
        if system is not None:
            prompt, p = np.concatenate([system, prompt]), p + system.shape[0]
        done: list[np.ndarray] = []
        for _ in range(min(g, opts.samples - len(out))):
            n = max(1, int(rng.lognormal(np.log(max(1, opts.completion_len)), 0.6)))
            comp = rng.integers(0, vocab, size=n)
            if done and rng.random() < 1 / 16:
                comp = done[int(rng.integers(len(done)))].copy()
            elif done and rng.random() < 1 / 3:
                prev = done[int(rng.integers(len(done)))]
                k = int(rng.integers(1, prev.shape[0] + 1))
                comp[: min(k, n)] = prev[: min(k, n)]
            done.append(comp)
            ids = np.concatenate([prompt, comp]).astype(np.int64)
            mask = np.zeros(ids.shape[0], dtype=bool)
            mask[p:] = True
            m = comp.shape[0]
            extras = {}
            if opts.topk:
                top_ids = rng.integers(0, vocab, size=(m, opts.topk)).astype(np.int64)
                top_lps = np.sort(-rng.random((m, opts.topk)) * 5, axis=1)[:, ::-1].astype(np.float32)
                extras[SAMPLER_TOPK] = TopK(top_ids, top_lps)
            lps = np.where(mask, -rng.random(ids.shape[0]) * 3, 0.0).astype(np.float32)
            out.append(
                TrainingSequence(
                    input_ids=ids,
                    train_mask=mask,
                    sampler_logprobs=lps,
                    advantage=float(rng.normal()),
                    token_extras=extras,
                    group_id=group,
                    prompt_seq=group,
                    group_num_samples=g,
                )
            )
    return out


def as_received(samples: list, group_size: int) -> list:
    """``samples`` as the trainer's rollout reader hands them out: each group pickled as one ``SampleBatch`` and
    read back (``sample_batch.py``), so their arrays are views of the group's columns, with unpickled dtypes."""
    import pickle

    from asyncgrpo_cli.sample_batch import SampleBatch

    g = max(1, group_size)
    return [
        s
        for i in range(0, len(samples), g)
        for s in pickle.loads(pickle.dumps(SampleBatch(samples[i : i + g]))).samples
    ]


def plan(planner: Any, samples: list, group_size: int = 0) -> list:
    """Every micro-batch ``planner`` emits for ``samples``, the final flush included: each group of ``group_size``
    samples in one ``add_group`` call (the rest again after a sample closed a micro-batch), or with
    ``group_size=0`` one ``add`` a sample."""
    from asyncgrpo_cli.packing.planner import group_adder

    if group_size <= 0:
        batches = [mb for s in samples if (mb := planner.add(s)) is not None]
    else:
        batches, add_group = [], group_adder(planner)
        for i in range(0, len(samples), group_size):
            run = samples[i : i + group_size]
            while run:
                added = add_group(run)
                if added.batch is not None:
                    batches.append(added.batch)
                run = run[added.taken :]
    last = planner.flush()
    return batches + ([last] if last is not None else [])


def cases(opts: Options) -> dict[str, tuple[Any, Any]]:
    """name -> (packer, planner factory) for the four packer x planner combinations."""
    from asyncgrpo_cli.config.schema import PackingConfig
    from asyncgrpo_cli.packing import planner_for
    from asyncgrpo_cli.packing.planner import FixedCountPlanner
    from asyncgrpo_cli.packing.sequence import SequencePacker
    from asyncgrpo_cli.packing.tree import TreePacker

    per_row = max(1, -(-opts.samples // (opts.rows * opts.ranks)))
    max_len = max(opts.system_len, 0) + opts.prompt_len * 2 + opts.completion_len * 8
    out = {}
    for name, packer in (
        ("sequence", SequencePacker(PackingConfig(kind="sequence"))),
        ("tree", TreePacker(PackingConfig(kind="tree", share_across_groups=bool(opts.share)))),
    ):
        budget_cls = planner_for(packer)
        out[f"{name} / token budget"] = (packer, lambda c=budget_cls: c(opts.token_budget, opts.ranks))
        out[f"{name} / fixed count"] = (packer, lambda: FixedCountPlanner(per_row, opts.ranks, max_len))
    return out


def run_case(
    packer: Any, planner: Any, samples: list, group_size: int = 0
) -> tuple[float, float, list, list]:
    """(planning seconds, packing seconds, micro-batches, packed rows) of one repeat: ``planner`` (empty: flushed
    by the repeat before) plans the step, as the trainer's one planner plans step after step (``group_size``:
    :func:`plan`'s)."""
    t0 = time.perf_counter()
    batches = plan(planner, samples, group_size)
    t1 = time.perf_counter()
    rows = [packer.pack(row) for mb in batches for row in mb.rows]
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, batches, rows


def main(argv: list[str]) -> None:
    import platform

    opts = parse_options(argv)
    if opts.samples < 1 or opts.repeats < 1 or opts.rows < 1 or opts.ranks < 1:
        raise UserError("asyncgrpo bench planning: samples, repeats, rows and ranks must be >= 1")
    samples = make_step(opts)
    if opts.transport == "batch":
        samples = as_received(samples, opts.group_size)
    n = len(samples)
    source = "as the rollout queue delivers them" if opts.transport == "batch" else "built in place"
    print(
        f"{n} samples in groups of {opts.group_size}, Σ L = {sum(map(len, samples))} tokens, "
        f"{sum(s.num_trained for s in samples)} trained, top-k {opts.topk}; token_budget {opts.token_budget}, "
        f"{opts.ranks} rank(s), samples {source}, fed {'by group' if opts.feed == 'group' else opts.feed}; "
        f"{platform.processor() or platform.machine()}, numpy {np.__version__}"
    )
    group_of = {"group": opts.group_size, "sample": 0}
    if opts.profile:
        import cProfile
        import pstats

        g = group_of["sample" if opts.feed == "sample" else "group"]
        for name, (packer, make_planner) in cases(opts).items():
            print(f"\n## {name}")
            planner = make_planner()
            run_case(packer, planner, samples, g)  # warm-up: numba's compiled kernels load on first use
            prof = cProfile.Profile()
            prof.runcall(run_case, packer, planner, samples, g)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(opts.profile)
        return
    memories = {"keep": ("kept",), "return": ("returned",), "both": ("kept", "returned")}[opts.host_memory]
    feeds = {"group": ("group",), "sample": ("sample",), "both": ("sample", "group")}[opts.feed]
    modes = [(memory, feed) for memory in memories for feed in feeds]
    print(
        "| case | micro-batches | rows | forwarded tokens | plan us/sample | pack us/sample | total | "
        "page faults/sample |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (packer, make_planner) in cases(opts).items():
        planner = make_planner()
        _set_host_memory(modes[0][0])
        for _, feed in modes:
            run_case(packer, planner, samples, group_of[feed])  # warm-up
        times: dict[tuple[str, str], list[tuple[float, float, int]]] = {m: [] for m in modes}
        shapes = set()
        # with both settings: A B B A ...; each repeat's rows are freed before the next
        for r in range(opts.repeats):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                _set_host_memory(mode[0])
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                plan_s, pack_s, batches, rows = run_case(packer, planner, samples, group_of[mode[1]])
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                times[mode].append((plan_s, pack_s, faults))
                shape = (len(batches), len(rows), sum(row.num_forwarded for row in rows))
                shapes.add((*shape, _rows_of(batches)))
                del batches, rows
        if len(shapes) > 1:
            raise RuntimeError(f"bench planning: {name} planned different rows by feed or memory setting")
        for mode in modes:
            plan_s, pack_s, faults = (statistics.median(t[i] for t in times[mode]) for i in range(3))
            parts = [f"{mode[0]} memory"] * (len(memories) > 1) + [f"fed by {mode[1]}"] * (len(feeds) > 1)
            label = f"{name} ({', '.join(parts)})" if parts else name
            print(
                f"| {label} | {shape[0]} | {shape[1]} | {shape[2]} | {plan_s / n * 1e6:.2f} | "
                f"{pack_s / n * 1e6:.2f} | {(plan_s + pack_s) / n * 1e6:.2f} | {faults / n:.2f} |"
            )
    _set_host_memory("kept")


def _rows_of(batches: list) -> tuple:
    """The planned rows as the identities of their samples (a filler row's context-only copy, made anew by each
    plan: its length)."""
    return tuple(
        tuple(len(s) if r in mb.filler_ranks else id(s) for s in row)
        for mb in batches
        for r, row in enumerate(mb.rows)
    )


def _set_host_memory(mode: str) -> None:
    """The trainer's setting (``kept``: ``host_memory.keep_freed_memory``) or glibc's starting thresholds
    (``returned``), switched within the process."""
    from asyncgrpo_cli import host_memory

    if mode == "kept":
        host_memory.set_thresholds(host_memory.KEEP)
    else:
        host_memory.set_thresholds(host_memory.RETURN, trim=True)
