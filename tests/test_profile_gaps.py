"""``train/profile_gaps.py``: the device's idle time in a Chrome trace and its long gaps by the host operation that
launched the next kernel, on hand-built traces (the event layout of torch.profiler's export)."""

from __future__ import annotations

from asyncgrpo_cli.train.profile_gaps import idle_lines, idle_report


def op(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def launch(ts, corr, dur=5, tid=1):
    return {**op("cudaLaunchKernel", ts, dur, "cuda_runtime", tid), "args": {"correlation": corr}}


def kernel(name, ts, dur, corr, stream=7, cat="kernel"):
    return {**op(name, ts, dur, cat, tid=stream), "pid": 0, "args": {"correlation": corr}}


def trace():
    """Two streams. Kernel a [100, 200) and a copy on another stream [150, 260); a 5 us launch-latency gap; kernel
    b [265, 300); a 100 us gap where the host was late (b2 launched at 395 inside FSDP::pre_forward > aten::copy_);
    kernel c queued long before it ran after a 50 us wait (another stream's event)."""
    return [
        op("FSDP::pre_forward", 380, 30, "user_annotation"),
        op("aten::copy_", 390, 12),
        op("aten::mm", 10, 5),
        launch(10, 1),
        launch(20, 2, tid=2),
        launch(30, 3),
        launch(395, 4),
        launch(40, 5),
        kernel("a", 100, 100, 1),
        kernel("Memcpy DtoD", 150, 110, 2, stream=8, cat="gpu_memcpy"),
        kernel("b", 265, 35, 3),
        kernel("b2", 400, 50, 4),
        kernel("c", 500, 20, 5),
    ]


def test_idle_is_the_span_less_the_union_of_device_work_and_long_gaps_are_attributed():
    r = idle_report(trace(), min_gap_us=20)
    assert r.span_us == 420 and r.busy_us == 100 + 60 + 35 + 50 + 20  # the overlap counted once
    assert r.short_us == 5 and r.idle_us == 155
    assert r.by_cause == {
        ("host-late", "FSDP::pre_forward", "aten::copy_"): 100,
        ("queued", "cudaLaunchKernel", "cudaLaunchKernel"): 50,
    }


def test_lines_are_per_step_and_absent_without_device_events():
    lines = idle_lines(trace(), steps=2, min_gap_us=20)
    assert lines[0] == (
        "GPU idle 0.1 ms per step of a 0.2 ms device span (36.9%): 0.1 ms in gaps >= 20 us, 0.0 ms in shorter ones "
        "(launch latency)"
    )
    assert "| 0.05 | 0.5 | host-late | FSDP::pre_forward | aten::copy_ |" in lines
    assert idle_lines([op("aten::mm", 0, 10)], steps=1) == []
