"""Recording one optimizer step's metrics into the window (rank 0): batch/*, sample/*, perf/*, loss-side."""

from __future__ import annotations

from dataclasses import dataclass

from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.train.batching import StepBatch


@dataclass
class StepTimes:
    step_s: float
    fwd_s: float
    fwd_bwd_s: float
    optimizer_s: float


def record_microbatches(w: MetricWindow, step: StepBatch) -> None:
    for mb in step.microbatches:
        for r in range(len(mb.rows)):
            w.add("batch/samples_per_row", float(mb.samples_per_row[r]))
            w.add("batch/row_tokens_mean", float(mb.tokens_per_row[r]))
            w.add("batch/row_tokens_max", float(mb.tokens_per_row[r]))
            w.add("batch/row_fill_frac", float(mb.row_fill_frac[r]))
        w.add("batch/row_imbalance", mb.row_imbalance)


def record_step(
    w: MetricWindow,
    step: StepBatch,
    records: tuple[dict[str, tuple[float, float]], dict[str, float]],
    loss: float,
    grad_norm: float,
    lr: float,
    forwarded: int,
    unpacked: int,
    times: StepTimes,
    aux_loss: tuple[float, float] | None = None,
) -> None:
    """``aux_loss``: (Σ raw router aux losses, rows) over every rank's rows of the step, for an MoE model with a
    non-zero coefficient (``model/router.py``); logged as ``aux_loss``, the mean over rows. None: not logged."""
    trained = step.num_trained
    rates, extremes = records  # the loss's (Loss.metric_records)
    for name, (num, den) in rates.items():
        w.add_rate(name, num, den)
    for name, value in extremes.items():
        w.add(name, value)
    w.add("loss", loss)
    if aux_loss is not None:
        w.add_rate("aux_loss", *aux_loss)
    w.add("grad_norm", grad_norm)
    w.add("learning_rate", lr)
    record_microbatches(w, step)
    w.add("batch/forwarded_tokens_per_step", forwarded)
    w.add("batch/trained_tokens_per_step", trained)
    w.add("batch/samples_per_step", len(step.samples))
    w.add("batch/groups_per_step", len({s.prompt_seq for s in step.samples}))
    w.add("batch/microbatches_per_step", len(step.microbatches))
    w.add_rate("batch/masked_token_frac", forwarded - trained, forwarded)
    w.add_rate("batch/packing_ratio", unpacked, forwarded)
    w.add("batch/pad_frac", 0.0)  # rows travel to their ranks as sample lists, never padded
    for s in step.samples:
        w.add("reward_kept", s.reward)
        w.add("reward_group_std", s.reward_group_std)
        for name, std in s.reward_func_group_std.items():
            w.add(f"rewards/{name}/group_std", std)
        w.add("sample/forwarded_tokens_mean", len(s))
        w.add("sample/forwarded_tokens_max", len(s))
        w.add("sample/trained_tokens_mean", s.num_trained)
    w.add("perf/step_s", times.step_s)
    w.add("perf/fwd_bwd_s", times.fwd_bwd_s)
    w.add("perf/fwd_s", times.fwd_s)
    w.add("perf/optimizer_s", times.optimizer_s)
    w.add("perf/rollout_wait_s", step.wait_s)
    w.add("perf/plan_s", step.plan_s)
    w.add_rate("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, times.fwd_bwd_s)
    w.add_rate("perf/wall_clock_forwarded_tokens_per_s", forwarded, times.step_s)
    w.add_rate("perf/wall_clock_trained_tokens_per_s", trained, times.step_s)
