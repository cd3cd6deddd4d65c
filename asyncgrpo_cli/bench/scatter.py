"""``asyncgrpo bench scatter``: what handing one step to the ranks costs, rank 0 scattering each rank's rows as
samples (how steps travelled before) against rows it packed (``train/distributed.rank_steps``), side by side.

With several ranks every step starts with ``scatter_step``: rank 0 pickles each rank's ``RankStep``
(``torch.distributed.scatter_object_list`` pickles every rank's object with the standard pickler), and no rank
starts its forward before it has unpickled its own and packed its first row. That is on every rank's critical
path. Workload: the synthetic step of ``asyncgrpo bench planning`` (same options and seed), delivered as the
rollout queue delivers it, planned by the packer's token-budget planner for ``ranks`` rows per micro-batch; every
micro-batch of the step goes to one optimizer step. Rounds alternate between the two ways (A B B A ...); per
way, medians over its rounds, in microseconds per sample of the step:

  - ``rank 0``: packing (packed rows only) and pickling every rank's ``RankStep``;
  - ``a rank's start``: the slowest rank's unpickling of its own, plus packing its first row (samples only: the
    other rows are packed under the GPU's work);
  - ``critical path``: the two added (the transfer itself is not timed here; ``bytes/sample`` is what it moves).

Not timed: the trainer packs rows planned ahead under the step before (``_prefetch_next``), which moves rank 0's
packing off the critical path whenever the next step is planned before this one ends.

Usage: asyncgrpo bench scatter [samples=2000] [group_size=16] [prompt_len=256] [completion_len=16] [topk=8]
       [token_budget=8192] [ranks=8] [kind=tree] [rounds=6] [seed=0]
"""

from __future__ import annotations

import pickle
import statistics
import time
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.errors import UserError

WAYS = ("samples", "packed rows")


@dataclass
class ScatterOptions:
    samples: int = 2000
    group_size: int = 16
    prompt_len: int = 256
    completion_len: int = 16
    topk: int = 8
    token_budget: int = 8192
    ranks: int = 8
    kind: str = "tree"
    rounds: int = 6
    seed: int = 0


def hand_out(way: str, rows_by_rank: list, num_trained: int, packer: Any) -> tuple[float, float, int]:
    """(rank 0 seconds, the slowest rank's start in seconds, bytes pickled) of one step handed out ``way``."""
    from asyncgrpo_cli.packing.row import PackedRow
    from asyncgrpo_cli.train.distributed import rank_steps

    t0 = time.perf_counter()
    per_rank = rank_steps(rows_by_rank, num_trained, packer.pack if way == "packed rows" else None)
    blobs = [pickle.dumps(step) for step in per_rank]
    rank0 = time.perf_counter() - t0
    start = 0.0
    for blob in blobs:
        t1 = time.perf_counter()
        mine = pickle.loads(blob)
        first = mine.rows[0]
        if not isinstance(first, PackedRow):
            packer.pack(first)
        start = max(start, time.perf_counter() - t1)
    return rank0, start, sum(map(len, blobs))


def main(argv: list[str]) -> None:
    from asyncgrpo_cli.bench.args import parse_key_values
    from asyncgrpo_cli.bench.planning import Options, as_received, make_step, plan
    from asyncgrpo_cli.config.schema import PackingConfig
    from asyncgrpo_cli.host_memory import keep_freed_memory
    from asyncgrpo_cli.packing import planner_for
    from asyncgrpo_cli.packing.sequence import SequencePacker
    from asyncgrpo_cli.packing.tree import TreePacker

    opts, errors = parse_key_values(ScatterOptions, argv)
    if opts is None:
        raise UserError("asyncgrpo bench scatter: " + "; ".join(errors))
    if opts.samples < 1 or opts.ranks < 1 or opts.rounds < 2 or opts.kind not in ("tree", "sequence"):
        raise UserError(
            "asyncgrpo bench scatter: samples and ranks must be >= 1, rounds >= 2, kind tree or sequence"
        )
    keep_freed_memory()  # the trainer's setting (trainer.keep_host_memory)
    step_opts = Options(
        samples=opts.samples,
        group_size=opts.group_size,
        prompt_len=opts.prompt_len,
        completion_len=opts.completion_len,
        topk=opts.topk,
        token_budget=opts.token_budget,
        ranks=opts.ranks,
        seed=opts.seed,
    )
    samples = as_received(make_step(step_opts), opts.group_size)
    packer = (TreePacker if opts.kind == "tree" else SequencePacker)(PackingConfig(kind=opts.kind))
    batches = plan(planner_for(packer)(opts.token_budget, opts.ranks), samples)
    rows_by_rank = [[mb.rows[r] for mb in batches] for r in range(opts.ranks)]
    trained = sum(s.num_trained for s in samples)
    n = len(samples)
    for way in WAYS:  # warm-up: compiled kernels, allocator
        hand_out(way, rows_by_rank, trained, packer)
    results: dict[str, list[tuple[float, float, int]]] = {w: [] for w in WAYS}
    for r in range(opts.rounds):
        way = WAYS[(r // 2 + r) % 2]  # A B B A ...
        results[way].append(hand_out(way, rows_by_rank, trained, packer))
    print(
        f"{n} samples in groups of {opts.group_size} (P = {opts.prompt_len}, C = {opts.completion_len}, top-k "
        f"{opts.topk}), {opts.kind} packing, {len(batches)} micro-batch(es) of {opts.ranks} rows of "
        f"{opts.token_budget} tokens; {opts.rounds} rounds alternating, medians per way"
    )
    print("| way | rank 0 us/sample | a rank's start us/sample | critical path us/sample | bytes/sample |")
    print("|---|---|---|---|---|")
    path = {}
    for way in WAYS:
        rank0, start, size = (statistics.median(x[i] for x in results[way]) for i in range(3))
        path[way] = rank0 + start
        print(
            f"| {way} | {rank0 / n * 1e6:.2f} | {start / n * 1e6:.2f} | {path[way] / n * 1e6:.2f} | "
            f"{size / n:.0f} |"
        )
    print(f"packed rows vs samples: critical path {path[WAYS[0]] / path[WAYS[1]]:.2f}x shorter")
