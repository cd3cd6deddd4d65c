"""Where the GPU sat idle in a recorded trace, and what the host was doing when it should have launched work.

``trainer.profile``'s summary (``train/profiler.py``) adds these lines for CUDA traces: the device's busy time
(the union of its kernels and copies over every stream) against the span from the first to the last, and the
idle gaps of at least ``min_gap_us`` grouped by the host operation that launched the kernel ending the gap. A gap
is *host-late* when that kernel started as soon as its launch returned: the GPU had drained its queue and waited
for the CPU (Python overhead, a host sync, packing on the critical path). Otherwise the kernel was queued
already and waited on something else (an event, another stream): *queued*. Short gaps (below ``min_gap_us``) are
the launch latency between dependent kernels, counted in the idle total only.

Read from the exported Chrome trace (``prof.export_chrome_trace``): its events carry the runtime calls'
correlation ids, which link each kernel to the ``cudaLaunchKernel`` (or copy) that queued it and so to the
enclosing CPU operators on that thread. torch.profiler has no such report of its own (its tables aggregate time
per operator, not the device's idle time).
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function")
LATE_US = 8.0
"""A kernel that starts within this many microseconds of its launch's return started on launch: host-late."""


@dataclass
class IdleReport:
    """The device's idle time in a trace (microseconds), and the long gaps by (kind, launching operators)."""

    span_us: float = 0.0
    busy_us: float = 0.0
    short_us: float = 0.0
    """Idle time in gaps shorter than the threshold (launch latency between kernels)."""
    by_cause: Counter = field(default_factory=Counter)
    """(``host-late`` | ``queued``, outer operator, inner operator) -> idle microseconds."""
    counts: Counter = field(default_factory=Counter)

    @property
    def idle_us(self) -> float:
        return self.span_us - self.busy_us


def idle_report(events: list[dict[str, Any]], min_gap_us: float = 20.0) -> IdleReport:
    """The :class:`IdleReport` of a Chrome trace's ``traceEvents`` (complete events, ``ph == "X"``)."""
    complete = [e for e in events if e.get("ph") == "X"]
    device = sorted((e for e in complete if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    report = IdleReport()
    if not device:
        return report
    launches = {
        e["args"]["correlation"]: e
        for e in complete
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    host = _HostOps([e for e in complete if e.get("cat") in HOST_CATS])
    end = device[0]["ts"]
    for k in device:
        gap = k["ts"] - end
        if gap > 0:
            if gap < min_gap_us:
                report.short_us += gap
            else:
                cause = _cause(k, launches.get(k.get("args", {}).get("correlation")), host)
                report.by_cause[cause] += gap
                report.counts[cause] += 1
        end = max(end, k["ts"] + k["dur"])
    report.span_us = end - device[0]["ts"]
    report.busy_us = report.span_us - report.short_us - sum(report.by_cause.values())
    return report


class _HostOps:
    """CPU-side events per thread, sorted by start, for "which operators enclose this instant"."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for e in events:
            by_thread[e["tid"]].append(e)
        self.events = {t: sorted(lst, key=lambda e: (e["ts"], -e["dur"])) for t, lst in by_thread.items()}
        self.starts = {t: [e["ts"] for e in lst] for t, lst in self.events.items()}
        self.longest = {t: max(e["dur"] for e in lst) for t, lst in self.events.items()}

    def enclosing(self, thread: Any, ts: float) -> list[str]:
        """Names of the operators on ``thread`` running at ``ts``, outermost first."""
        lst, starts = self.events.get(thread, []), self.starts.get(thread, [])
        i = bisect.bisect_right(starts, ts)
        first = bisect.bisect_left(starts, ts - self.longest.get(thread, 0))
        return [e["name"] for e in lst[first:i] if e["ts"] + e["dur"] >= ts]


def _cause(kernel: dict[str, Any], launch: dict[str, Any] | None, host: _HostOps) -> tuple[str, str, str]:
    if launch is None:  # e.g. a Triton launcher's driver call the trace did not link
        return ("queued", "-", f"(no launch record) {kernel['name'][:60]}")
    late = launch["ts"] + launch["dur"] >= kernel["ts"] - LATE_US
    names = host.enclosing(launch["tid"], launch["ts"]) or [launch["name"]]
    return ("host-late" if late else "queued", names[0][:70], names[-1][:70])


def idle_lines(events: list[dict[str, Any]], steps: int, min_gap_us: float = 20.0, top: int = 8) -> list[str]:
    """The summary's idle section for a trace of ``steps`` steps (no lines when it holds no device events)."""
    r = idle_report(events, min_gap_us)
    if r.span_us <= 0:
        return []
    ms = lambda us: us / steps / 1e3  # noqa: E731 (per step, in ms)
    long_us = sum(r.by_cause.values())
    lines = [
        f"GPU idle {ms(r.idle_us):.1f} ms per step of a {ms(r.span_us):.1f} ms device span "
        f"({100 * r.idle_us / r.span_us:.1f}%): {ms(long_us):.1f} ms in gaps >= {min_gap_us:g} us, "
        f"{ms(r.short_us):.1f} ms in shorter ones (launch latency)",
    ]
    if r.by_cause:
        lines += [
            "",
            "| idle ms per step | gaps per step | kind | outer host op | op that launched the next kernel |",
            "|---|---|---|---|---|",
        ]
        for (kind, outer, inner), us in r.by_cause.most_common(top):
            n = r.counts[(kind, outer, inner)] / steps
            lines.append(f"| {ms(us):.2f} | {n:g} | {kind} | {outer} | {inner} |")
    return lines
