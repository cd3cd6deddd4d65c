"""``trainer.profile``: torch.profiler traces of chosen optimizer steps, and where their time went.

The steps of ``trainer.profile.steps`` are recorded in runs of consecutive steps: steps [5, 6, 9] give one trace
of steps 5-6 and one of step 9. A recorded step is the whole loop iteration: waiting for and planning the step
(rank 0), the scatter, forward/backward, the metric reduction, the optimizer step and a weight sync when one is
due. Each rank writes, under the run directory's ``profile/``:

- ``steps-A-B-rank-R.json.gz``: the trace (open it in Perfetto or ``chrome://tracing``);
- ``steps-A-B-rank-R.txt``: the device's kernel time per step by kind and the top kernels, against the steps'
  wall time (on CPU: operators' self time instead of kernels); on CUDA also the device's idle time and its long
  gaps by the host operation that launched the next kernel (``train/profile_gaps.py``).

torch.profiler records and exports the trace; the summary is written here because the profiler's own table
(``key_averages``) lists CPU operators and the kernels they launch side by side, so summing it counts the GPU
time twice, and it has no notion of which kernels are attention, matmuls or the optimizer. The kinds come from
kernel names (:func:`kind_of`): Triton, cuBLAS and NCCL names, so a kernel this table does not know is ``other``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from asyncgrpo_cli.config.schema import ProfileConfig

logger = logging.getLogger(__name__)

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flex_attention", "flash", "fmha", "scaled_dot_product", "attention")),
    ("LM head (fused)", ("grad_kernel", "stats_kernel")),
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("communication", ("nccl", "c10d", "all_gather", "reduce_scatter", "all_reduce", "broadcast")),
    ("copies", ("memcpy", "memset", "copy", "chunk_cat", "aten::cat")),
    ("fused element-wise (Inductor)", ("triton_",)),
)
"""Kernel kind -> substrings of the (lower-cased) kernel or operator name; the first kind that matches wins."""


def kind_of(name: str) -> str:
    """The :data:`KINDS` entry of a kernel or operator name; ``other`` when none matches."""
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def summary(
    rows: list[tuple[str, float, int]],
    steps: tuple[int, int],
    wall_s: float,
    top: int,
    device: str,
    idle: list[str] | None = None,
) -> str:
    """The text summary of recorded kernels ``rows`` = (name, total microseconds, calls) over ``steps`` (first,
    last) that took ``wall_s`` seconds in all: per-step time by kind and the ``top`` kernels; ``idle``: the
    device's idle section (``train/profile_gaps.idle_lines``), after the kinds."""
    n = steps[1] - steps[0] + 1
    total = sum(us for _, us, _ in rows)
    by_kind: dict[str, float] = defaultdict(float)
    for name, us, _ in rows:
        by_kind[kind_of(name)] += us
    ms = lambda us: us / n / 1e3  # noqa: E731 (per step, in ms)
    what = "kernel" if device.startswith("cuda") else "operator self"
    lines = [
        f"steps {steps[0]}-{steps[1]} on {device}: wall {wall_s / n * 1e3:.1f} ms per step, {what} time "
        f"{ms(total):.1f} ms per step ({100 * total / 1e6 / max(wall_s, 1e-9):.0f}% of wall)",
        "",
        "| kind | ms per step | share |",
        "|---|---|---|",
    ]
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {ms(us):.2f} | {100 * us / max(total, 1e-9):.1f}% |")
    if idle:
        lines += ["", *idle]
    lines += ["", f"top {top}:", "| ms per step | calls per step | kind | name |", "|---|---|---|---|"]
    for name, us, calls in sorted(rows, key=lambda r: -r[1])[:top]:
        lines.append(f"| {ms(us):.2f} | {calls / n:g} | {kind_of(name)} | {name[:160]} |")
    return "\n".join(lines) + "\n"


def recorded_rows(prof: Any, cuda: bool) -> list[tuple[str, float, int]]:
    """(name, total us, calls) of the profiler's kernels (CUDA) or of its CPU operators' self time (CPU). On CUDA,
    ``record_function`` ranges also show on the device's timeline (``is_user_annotation``: the optimizer step, an
    autograd Function) and span kernels listed on their own: they are left out, as torch's own total does."""
    from torch.autograd import DeviceType

    rows = []
    for e in prof.key_averages():
        if cuda and e.device_type == DeviceType.CUDA and not e.is_user_annotation:
            rows.append((e.key, float(e.self_device_time_total), int(e.count)))
        elif not cuda and e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0:
            rows.append((e.key, float(e.self_cpu_time_total), int(e.count)))
    return rows


class StepProfiler:
    """Records the steps of ``cfg.steps`` (see the module docstring): :meth:`before` the step's iteration,
    :meth:`after` it, :meth:`close` when the loop ends (a recording still open is written)."""

    def __init__(self, cfg: ProfileConfig, out_dir: Path, rank: int, device: Any) -> None:
        self.cfg, self.out_dir, self.rank, self.device = cfg, Path(out_dir), rank, device
        self._steps = set(cfg.steps)
        self._prof: Any = None
        self._first, self._last, self._t0 = 0, 0, 0.0
        self.written: list[Path] = []
        self.summaries: list[str] = []
        """The text summary of each recording written, in order."""

    def before(self, step: int) -> None:
        """``step`` (counted from 1) is about to run: start recording when it is the first of a run of steps."""
        if self._prof is not None or step not in self._steps:
            return
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof = profile(
            activities=activities, record_shapes=self.cfg.record_shapes, with_stack=self.cfg.with_stack
        )
        self._prof.start()
        self._first, self._last, self._t0 = step, step, time.perf_counter()

    def after(self, step: int) -> None:
        """``step`` ran: stop and write when the next step is not recorded."""
        if self._prof is None:
            return
        self._last = step
        if step + 1 not in self._steps:
            self._finish()

    def close(self) -> None:
        """Write a recording the loop left open (the run ended inside a run of recorded steps, or failed)."""
        if self._prof is not None:
            self._finish()

    def _finish(self) -> None:
        import torch

        prof, self._prof = self._prof, None
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._t0
        prof.stop()
        steps = (self._first, self._last)
        stem = f"steps-{steps[0]}-{steps[1]}-rank-{self.rank}"
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            trace = self.out_dir / f"{stem}.json.gz"
            prof.export_chrome_trace(str(trace))
            idle = _idle_of(trace, steps[1] - steps[0] + 1) if cuda else None
            text = summary(recorded_rows(prof, cuda), steps, wall, self.cfg.top, str(self.device), idle)
            (self.out_dir / f"{stem}.txt").write_text(text)
        except (OSError, RuntimeError) as e:  # a full disk must not stop the run
            logger.warning("trainer.profile: could not write the profile of steps %s-%s: %s", *steps, e)
            return
        self.written += [trace, self.out_dir / f"{stem}.txt"]
        self.summaries.append(text)
        logger.info("trainer.profile: %s (%s)", trace, text.splitlines()[0])


def _idle_of(trace: Path, steps: int) -> list[str]:
    """The idle section of a written trace (``train/profile_gaps.py``); none when it cannot be read back."""
    import gzip
    import json

    from asyncgrpo_cli.train.profile_gaps import idle_lines

    try:
        with gzip.open(trace, "rt") as f:
            events = json.load(f).get("traceEvents", [])
    except (OSError, ValueError) as e:
        logger.warning("trainer.profile: could not read %s back for its idle time: %s", trace, e)
        return []
    return idle_lines(events, steps)
