"""Adaptive concurrency (reference h.2): the controller on plain numbers, the Prometheus parser on vLLM's text
format, and the async poller against a stdlib fake server that scripts ``/metrics`` sequences."""

from __future__ import annotations

import asyncio
import math
import socket
import time

import pytest

from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.concurrency import (
    ConcurrencyController,
    MetricsFormatError,
    MetricsPoller,
    cache_tokens,
    parse_prometheus,
    read_vllm_load,
)
from tests.helpers.fake_server import DROP, FakeVllmServer, metrics_page


def started(max_concurrent: int = 512, kv_tokens: int | None = 8192, max_model_len: int = 1024):
    c = ConcurrencyController(max_concurrent)
    c.initialize(kv_tokens, max_model_len)
    return c


# -- the state machine ----------------------------------------------------------------------------------------
def test_initial_cap_is_kv_tokens_over_max_model_len_within_bounds():
    assert started(kv_tokens=8192, max_model_len=1024).cap == 8
    assert started(kv_tokens=8191, max_model_len=1024).cap == 7  # whole requests only
    assert started(max_concurrent=5, kv_tokens=8192, max_model_len=1024).cap == 5  # ceiling
    assert started(kv_tokens=512, max_model_len=1024).cap == 1  # floor: less than one request still runs one
    assert started(max_concurrent=64, kv_tokens=None).cap == 64  # capacity unknown: the user's bound


def test_before_any_poll_the_cap_is_max_concurrent_and_observations_are_ignored():
    c = ConcurrencyController(64)
    assert c.mode == "unknown" and c.cap == 64
    assert c.observe(0.95, 0) == "hold" and c.cap == 64


def test_grows_25_percent_at_most_once_per_cap_finished_rollouts():
    c = started()  # cap 8
    assert c.observe(0.30, 0) == "hold"  # nothing finished yet
    c.on_rollout_finished(7)
    assert c.observe(0.30, 0) == "hold"  # 7 < cap
    c.on_rollout_finished()
    assert c.observe(0.30, 0) == "grow" and c.cap == 10
    assert c.completed_since_raise == 0
    assert c.observe(0.30, 0) == "hold" and c.cap == 10  # the next raise needs 10 more
    c.on_rollout_finished(10)
    assert c.observe(0.10, 0) == "grow" and c.cap == 12


def test_growth_from_one_always_adds_at_least_one():
    c = started(kv_tokens=100, max_model_len=1024)
    caps = []
    for _ in range(10):
        c.on_rollout_finished(c.cap)
        c.observe(0.0, 0)
        caps.append(c.cap)
    assert caps == [2, 3, 4, 5, 6, 7, 8, 10, 12, 15]


def test_shrinks_30_percent_above_80_percent_down_to_one():
    c = started(kv_tokens=10 * 1024)  # cap 10
    c.on_rollout_finished(100)  # completions do not prevent shrinking
    caps = []
    for _ in range(6):
        assert c.observe(0.81, 0) == "shrink"
        caps.append(c.cap)
    assert caps == [7, 4, 2, 1, 1, 1]


def test_holds_between_60_and_80_percent_and_at_the_boundaries():
    c = started()  # cap 8
    c.on_rollout_finished(100)
    for usage in (0.60, 0.65, 0.79, 0.80):
        assert c.observe(usage, 0) == "hold"
        assert c.cap == 8
    assert c.observe(0.5999, 0) == "grow"


def test_waiting_requests_block_growth_but_not_shrinking():
    c = started()
    c.on_rollout_finished(100)
    assert c.observe(0.10, 1) == "hold" and c.cap == 8
    assert c.observe(0.10, 0.5) == "hold" and c.cap == 8  # a mean over engines can be fractional
    assert c.observe(0.90, 3) == "shrink" and c.cap == 5


def test_never_above_max_concurrent():
    c = started(max_concurrent=9)  # cap 8
    c.on_rollout_finished(8)
    assert c.observe(0.1, 0) == "grow" and c.cap == 9  # 10 clamped to the ceiling
    c.on_rollout_finished(100)
    assert c.observe(0.1, 0) == "hold" and c.cap == 9


def test_fallback_without_metrics_is_max_concurrent():
    c = started()
    c.observe(0.95, 0)
    assert c.cap == 5
    c.fallback()
    assert c.mode == "fallback" and c.cap == 512
    c.on_rollout_finished(1000)
    assert c.observe(0.95, 4) == "hold" and c.cap == 512


def test_switched_off_the_cap_is_max_concurrent_whatever_is_observed():
    c = ConcurrencyController(32, adaptive=False)
    c.initialize(1024, 1024)
    c.observe(0.99, 0)
    assert c.cap == 32


def test_rejects_a_zero_ceiling():
    with pytest.raises(ValueError, match="max_concurrent_rollouts"):
        ConcurrencyController(0)


# -- the Prometheus parser ------------------------------------------------------------------------------------
M = 'model_name="Qwen/Qwen3-0.6B"'
VLLM_TWO_ENGINES = f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 1234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{M}}} 12.0
vllm:num_requests_running{{engine="1",{M}}} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{M}}} 2.0
vllm:num_requests_waiting{{engine="1",{M}}} 1.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{{engine="0",{M},reason="capacity"}} 2.0
vllm:num_requests_waiting_by_reason{{engine="0",{M},reason="deferred"}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{M}}} 0.4375
vllm:kv_cache_usage_perc{{engine="1",{M}}} 0.71875
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",{M}}} 3.0
vllm:num_preemptions_total{{engine="1",{M}}} 4.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{{engine="0",{M}}} 1.7648064e+09
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="0.3",{M}}} 0.0
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",{M}}} 31.0
vllm:e2e_request_latency_seconds_count{{engine="0",{M}}} 31.0
vllm:e2e_request_latency_seconds_sum{{engine="0",{M}}} 44.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",\
enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",\
kv_cache_max_concurrency="53.33",kv_cache_size_tokens="436912",num_cpu_blocks="None",num_gpu_blocks="27307",\
num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4"}} 1.0
vllm:cache_config_info{{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",\
enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",is_attention_free="False",\
kv_cache_max_concurrency="53.33",kv_cache_size_tokens="436896",num_cpu_blocks="None",num_gpu_blocks="27306",\
num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4"}} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}} 1.7648064e+09
"""


def test_vllm_text_with_two_engines():
    load = read_vllm_load(VLLM_TWO_ENGINES)
    assert load.kv_usage == 0.71875  # max across engines
    assert load.running == 21 and load.waiting == 3  # summed; waiting_by_reason is not counted again
    assert load.preemptions_total == 7  # the counter, summed; the _created series is ignored
    assert load.kv_cache_tokens == 436912  # max across engines
    assert load.num_engines == 2


def test_parser_reads_labels_escapes_special_values_and_timestamps():
    text = (
        'm{a="x, y",b="say \\"hi\\"",c="back\\\\slash",d="line\\nbreak",e="}{"} 1.5 1700000000000\n'
        "n +Inf\n"
        "o NaN\n"
        'p{le="+Inf",} 2e3\n'
        "this line is garbage\n"
        'q{unterminated="x} 1\n'
    )
    samples = {s.name: s for s in parse_prometheus(text)}
    assert set(samples) == {"m", "n", "o", "p"}  # malformed lines are skipped
    assert samples["m"].labels == {
        "a": "x, y",
        "b": 'say "hi"',
        "c": "back\\slash",
        "d": "line\nbreak",
        "e": "}{",
    }
    assert samples["m"].value == 1.5
    assert samples["n"].value == math.inf and math.isnan(samples["o"].value)
    assert samples["p"].labels == {"le": "+Inf"} and samples["p"].value == 2000.0


def test_cache_tokens_falls_back_to_blocks_times_block_size():
    assert cache_tokens({"kv_cache_size_tokens": "2097152"}) == 2097152
    assert cache_tokens({"kv_cache_size_tokens": "None", "num_gpu_blocks": "100", "block_size": "16"}) == 1600
    assert (
        cache_tokens({"num_gpu_blocks": "100", "block_size": "16"}) == 1600
    )  # vLLM before the label existed
    assert cache_tokens({"num_gpu_blocks": "0", "block_size": "16"}) is None  # not allocated yet
    assert cache_tokens({"block_size": "16"}) is None
    page = metrics_page(usage=0.2, kv_cache_tokens=None)
    assert read_vllm_load(page).kv_cache_tokens is None


def test_pages_that_are_not_vllm_metrics_are_rejected():
    with pytest.raises(MetricsFormatError):
        read_vllm_load("<html><body>Not here</body></html>")
    with pytest.raises(MetricsFormatError):
        read_vllm_load("# HELP other_metric x\nother_metric 1\n")
    legacy = read_vllm_load('vllm:gpu_cache_usage_perc{model_name="m"} 0.25\nvllm:num_requests_waiting 0\n')
    assert legacy.kv_usage == 0.25  # vLLM's V0 name


def test_the_embedded_servers_metrics_page_parses():
    from asyncgrpo_cli.config.schema import EmbeddedServerConfig
    from asyncgrpo_cli.embedded.engine import EngineStats
    from asyncgrpo_cli.embedded.metrics import render_metrics

    stats = EngineStats(
        running=3,
        waiting=2,
        kv_usage=0.5,
        preemptions_total=4,
        prompt_tokens_total=100,
        generation_tokens_total=200,
        request_success_total={"length": 2},
        prefix_cache_queries_total=5,
        prefix_cache_hits_total=1,
        prefill_tokens_total=90,
    )
    cfg = EmbeddedServerConfig(kv_cache_tokens=65536, max_model_len=2048)
    load = read_vllm_load(render_metrics(stats, 'my "model"', cfg))
    assert (load.kv_usage, load.running, load.waiting, load.preemptions_total) == (0.5, 3, 2, 4)
    assert load.kv_cache_tokens == 65536


# -- the poller against a fake server -------------------------------------------------------------------------
def make_poller(srv: FakeVllmServer, max_concurrent: int = 512, interval_s: float = 5.0):
    window = MetricWindow()
    ctrl = ConcurrencyController(max_concurrent)
    poller = MetricsPoller(
        srv.base_url, ctrl, window, max_model_len=256, interval_s=interval_s, timeout_s=2.0
    )
    return poller, ctrl, window


def test_poller_follows_a_scripted_load_sequence():
    pages = [
        metrics_page(usage=0.30, preemptions=5),  # initial cap 8192 // 256 = 32; nothing finished: hold
        metrics_page(usage=0.30, preemptions=9),  # 32 finished: +25% -> 40
        metrics_page(
            usage=[0.50, 0.85], running=[20, 20], preemptions=[1, 1]
        ),  # one engine > 80%: -30% -> 28
        metrics_page(usage=0.70, preemptions=4),  # hold
        metrics_page(usage=0.20, waiting=[2], preemptions=4),  # requests wait: hold
        metrics_page(usage=0.20, preemptions=6),  # grow -> 35
    ]
    finished_before = [0, 32, 0, 100, 0, 0]
    with FakeVllmServer(metrics=pages) as srv:

        async def drive() -> list[int]:
            poller, ctrl, _ = make_poller(srv)
            caps = []
            try:
                for n in finished_before:
                    ctrl.on_rollout_finished(n)
                    assert await poller.poll_once() == "ok"
                    caps.append(ctrl.cap)
            finally:
                await poller.close()
            return caps

        caps = asyncio.run(drive())
    assert caps == [32, 40, 28, 28, 28, 35]


def test_poller_records_the_vllm_metrics_with_preemption_deltas():
    pages = [
        metrics_page(usage=0.2, running=4, waiting=0, preemptions=5),
        metrics_page(usage=[0.4, 0.6], running=[3, 5], waiting=[1, 1], preemptions=[4, 5]),  # +4
        metrics_page(usage=0.1, running=1, waiting=0, preemptions=2),  # counter reset (restart): +2
        metrics_page(usage=0.3, running=2, waiting=0, preemptions=4),  # +2
    ]
    with FakeVllmServer(metrics=pages) as srv:

        async def drive() -> MetricWindow:
            poller, _, window = make_poller(srv)
            try:
                for _ in pages:
                    await poller.poll_once()
            finally:
                await poller.close()
            return window

        out = asyncio.run(drive()).reduce()
    assert out["rollout/vllm_kv_cache_usage_frac"] == pytest.approx(
        (0.2 + 0.6 + 0.1 + 0.3) / 4
    )  # mean of maxima
    assert out["rollout/vllm_running_requests"] == pytest.approx((4 + 8 + 1 + 2) / 4)
    assert out["rollout/vllm_queued_requests"] == pytest.approx(2 / 4)
    assert out["rollout/vllm_preemption_count"] == 8  # deltas summed; the first poll is the baseline


@pytest.mark.parametrize("answer", [404, 403, "<html>no metrics here</html>"])
def test_no_metrics_endpoint_falls_back_to_max_concurrent_and_stops_polling(answer):
    with FakeVllmServer(metrics=[answer]) as srv:

        async def drive() -> tuple[str, int, bool]:
            poller, ctrl, _ = make_poller(srv, max_concurrent=48, interval_s=0.01)
            try:
                await poller.start()
                await asyncio.sleep(0.2)
                return ctrl.mode, ctrl.cap, poller._task is None
            finally:
                await poller.close()

        mode, cap, stopped = asyncio.run(drive())
        assert (mode, cap, stopped) == ("fallback", 48, True)
        assert srv.requests["/metrics"] == 1


def test_failed_polls_keep_the_last_cap_and_are_counted():
    with FakeVllmServer(metrics=[metrics_page(usage=0.9)]) as srv:

        async def drive() -> tuple[list[str], list[int], MetricWindow, MetricsPoller]:
            poller, ctrl, window = make_poller(srv)
            results, caps = [], []
            try:
                results.append(await poller.poll_once())  # 32 -> -30% -> 22
                caps.append(ctrl.cap)
                srv.fail("/metrics", times=1, status=500)
                results.append(await poller.poll_once())
                caps.append(ctrl.cap)
                srv.fail("/metrics", times=1, status=DROP)
                results.append(await poller.poll_once())
                caps.append(ctrl.cap)
                srv.stop()  # connection refused
                results.append(await poller.poll_once())
                caps.append(ctrl.cap)
                srv.start()
                results.append(await poller.poll_once())  # back: 22 -> 15
                caps.append(ctrl.cap)
            finally:
                await poller.close()
            return results, caps, window, poller

        results, caps, window, poller = asyncio.run(drive())
    assert results == ["ok", "failed", "failed", "failed", "ok"]
    assert caps == [22, 22, 22, 22, 15]
    assert poller.failures == 3 and window.reduce()["rollout/vllm_metrics_poll_failure_count"] == 3


def test_a_slow_metrics_endpoint_times_out_without_raising():
    with FakeVllmServer(metrics=[metrics_page(usage=0.3)]) as srv:

        async def drive() -> tuple[str, float]:
            ctrl = ConcurrencyController(16)
            poller = MetricsPoller(srv.base_url, ctrl, MetricWindow(), 256, interval_s=5.0, timeout_s=0.3)
            srv.stop()
            # a listening socket that never answers: accept nothing, so the request waits until the timeout
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", srv.port))
            sock.listen(8)
            try:
                t0 = time.monotonic()
                result = await poller.poll_once()
                return result, time.monotonic() - t0
            finally:
                sock.close()
                await poller.close()

        result, elapsed = asyncio.run(drive())
    assert result == "failed" and elapsed < 3.0


def test_background_polling_follows_the_server():
    pages = [metrics_page(usage=0.3)] + [metrics_page(usage=0.95)] * 3 + [metrics_page(usage=0.7)]
    with FakeVllmServer(metrics=pages) as srv:

        async def drive() -> tuple[int, int]:
            poller, ctrl, _ = make_poller(srv, interval_s=0.02)
            try:
                await poller.start()
                assert ctrl.cap == 32  # the first poll happens in start(): the initial cap is known at once
                deadline = time.monotonic() + 10
                while poller.polls < 8 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
            finally:
                await poller.close()
            return ctrl.cap, poller.polls

        cap, polls = asyncio.run(drive())
    assert polls >= 8
    assert cap == 32 * 7 // 10 * 7 // 10 * 7 // 10  # three shrinks, then held at 70 %


def test_poll_interval_must_be_positive():
    with pytest.raises(ValueError, match="metrics_poll_interval_s"):
        MetricsPoller("http://127.0.0.1:9", ConcurrencyController(4), MetricWindow(), 256, interval_s=0)
