"""``asyncgrpo bench transport``: what it costs the trainer to take a step's samples off the rollout queue, with
every sample its own message (how samples travelled before ``sample_batch.py``) against one ``SampleBatch`` per
group (how the rollout process sends them now), side by side in one run.

A spawned producer process (like the rollout process) builds the synthetic step of ``asyncgrpo bench planning``
(the same options and seed) and puts it on a ``multiprocessing.Queue`` once per round, per sample or per group;
the trainer side takes it through the trainer's own reader (``sample_batch.QueueReader``). Rounds alternate
between the two ways (A B B A ...). Reported per way, medians over its rounds: the trainer thread's CPU time per
sample (``time.thread_time``: unpickling, pipe reads, locks; waiting excluded), the wall time per sample of the
whole round, the producer's CPU time per sample (its queue's feeder thread pickles), and the trainer's page faults.
The trainer side keeps freed host memory, as the trainer does (``trainer.keep_host_memory``).

Usage: asyncgrpo bench transport [samples=2000] [group_size=16] [prompt_len=256] [completion_len=16] [topk=8]
       [rounds=6] [seed=0]
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.errors import UserError

WAYS = ("per sample", "per group")
ROUND_TIMEOUT_S = 300.0


@dataclass
class TransportOptions:
    samples: int = 2000
    group_size: int = 16
    prompt_len: int = 256
    completion_len: int = 16
    topk: int = 8
    rounds: int = 6
    seed: int = 0


def _producer(opts: TransportOptions, commands: Any, items: Any, costs: Any) -> None:
    """The spawned sender: one round per command (a way's index), then None; reports its CPU seconds a round."""
    from asyncgrpo_cli.bench.planning import Options, make_step
    from asyncgrpo_cli.sample_batch import SampleBatch

    step = make_step(
        Options(
            samples=opts.samples,
            group_size=opts.group_size,
            prompt_len=opts.prompt_len,
            completion_len=opts.completion_len,
            topk=opts.topk,
            seed=opts.seed,
        )
    )
    groups: dict[int, list] = {}
    for s in step:
        groups.setdefault(s.group_id, []).append(s)
    costs.put(len(step))
    while (way := commands.get(timeout=ROUND_TIMEOUT_S)) is not None:
        t0 = time.process_time()
        if WAYS[way] == "per sample":
            for s in step:
                items.put(s)
        else:
            for group in groups.values():
                items.put(SampleBatch(group))
        items.put(None)
        while items._buffer:  # the feeder thread still pickles: count its time in this round
            time.sleep(0.001)
        costs.put(time.process_time() - t0)


def main(argv: list[str]) -> None:
    import multiprocessing as mp

    from asyncgrpo_cli.bench.args import parse_key_values
    from asyncgrpo_cli.host_memory import keep_freed_memory
    from asyncgrpo_cli.sample_batch import QueueReader

    opts, errors = parse_key_values(TransportOptions, argv)
    if opts is None:
        raise UserError("asyncgrpo bench transport: " + "; ".join(errors))
    if opts.samples < 1 or opts.group_size < 1 or opts.rounds < 2:
        raise UserError("asyncgrpo bench transport: samples and group_size must be >= 1, rounds >= 2")
    keep_freed_memory()  # the trainer's setting (trainer.keep_host_memory)
    ctx = mp.get_context("spawn")
    commands, items, costs = ctx.Queue(), ctx.Queue(), ctx.Queue()
    producer = ctx.Process(target=_producer, args=(opts, commands, items, costs), daemon=True)
    producer.start()
    results: dict[str, list[tuple[float, float, float, int]]] = {w: [] for w in WAYS}
    try:
        n = costs.get(timeout=ROUND_TIMEOUT_S)
        order = [(r // 2 + r) % 2 for r in range(opts.rounds)]  # 0 1 1 0 0 1 ...
        for way in order:
            reader = QueueReader(items)
            commands.put(way)
            first = reader.get(timeout=ROUND_TIMEOUT_S)  # the producer has started: time from here
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            cpu, wall = time.thread_time(), time.perf_counter()
            taken = [first]
            while (item := reader.get(timeout=ROUND_TIMEOUT_S)) is not None:
                taken.append(item)
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            if len(taken) != n:
                raise RuntimeError(f"round of {WAYS[way]!r} delivered {len(taken)} of {n} samples")
            del taken
            sent = costs.get(timeout=ROUND_TIMEOUT_S)
            results[WAYS[way]].append((cpu / (n - 1), wall / (n - 1), sent / n, faults))
        commands.put(None)
        producer.join(30)
    finally:
        if producer.is_alive():
            producer.kill()
    print(
        f"{n} samples in groups of {opts.group_size} (P = {opts.prompt_len}, C = {opts.completion_len}, top-k "
        f"{opts.topk}), {opts.rounds} rounds alternating; medians per way"
    )
    print("| way | trainer CPU us/sample | wall us/sample | producer CPU us/sample | trainer page faults |")
    print("|---|---|---|---|---|")
    med = {}
    for way in WAYS:
        rows = results[way]
        med[way] = [statistics.median(r[i] for r in rows) for i in range(4)]
        cpu, wall, sent, faults = med[way]
        print(f"| {way} | {cpu * 1e6:.2f} | {wall * 1e6:.2f} | {sent * 1e6:.2f} | {faults:.0f} |")
    a, b = med[WAYS[0]], med[WAYS[1]]
    print(f"per group vs per sample: trainer CPU {a[0] / b[0]:.2f}x less, wall {a[1] / b[1]:.2f}x less")
