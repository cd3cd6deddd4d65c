"""Metrics: window reduction rules (reference g.1), JSONL and trackio sinks, console view, logger fan-out."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pickle
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from rich.logging import RichHandler
from rich.text import Text

from asyncgrpo_cli.config.schema import LoggingConfig
from asyncgrpo_cli.metrics import sinks as sinks_mod
from asyncgrpo_cli.metrics.console import ConsoleView, LiveLogging
from asyncgrpo_cli.metrics.logger import SINK_NAMES, MetricsLogger
from asyncgrpo_cli.metrics.reducer import MetricWindow, aggregation, reduce_metric
from asyncgrpo_cli.metrics.sinks import JsonlSink, TrackioSink

NAN = float("nan")


# -- reduction rules ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, how",
    [
        ("sample/dropped_stale_count", "sum"),
        ("tools/search/call_count", "sum"),
        ("rollout/vllm_retry_count", "sum"),
        ("distill/teacher_tokens_total", "sum"),  # the reference's distillation counters say 'total'
        ("rollout/total_samples", "sum"),
        ("stats/Total", "sum"),
        ("completions/max_length", "max"),
        ("sampling/importance_sampling_ratio/max", "max"),
        ("sample/staleness_max", "max"),
        ("clip_ratio/high_max", "max"),
        ("clip_ratio/low_min", "min"),
        ("completions/min_terminated_length", "min"),
        ("sampling/importance_sampling_ratio/min", "min"),
        ("reward", "mean"),
        ("completions/mean_length", "mean"),
        # whole words of the last segment only
        ("stats/maximum", "mean"),
        ("stats/country", "mean"),
        ("stats/minutes_s", "mean"),
        ("stats/accountant", "mean"),
        ("stats/totally", "mean"),
        ("stats/subtotals", "mean"),
        ("total/reward", "mean"),  # 'total' in an earlier segment does not count
        ("max/value", "mean"),  # 'max' in an earlier segment does not count
        ("count/reward", "mean"),
        ("stats/Max_len", "max"),  # case-insensitive
        ("stats/count_max", "sum"),  # count wins over max (rule 3 before rule 4)
    ],
)
def test_aggregation_by_last_segment_words(name, how):
    assert aggregation(name) == how


def test_reduce_metric_each_rule():
    assert reduce_metric("sample/dropped_stale_count", [1, 2, 3]) == 6
    assert reduce_metric("distill/teacher_tokens_total", [10, 20, 5]) == 35
    assert reduce_metric("completions/max_length", [12, 40, 7]) == 40
    assert reduce_metric("clip_ratio/low_min", [0.3, 0.05, 0.2]) == 0.05
    assert reduce_metric("reward", [1.0, 0.0, 0.5, 0.5]) == 0.5
    with pytest.raises(ValueError):
        reduce_metric("reward", [])


def test_reduce_metric_nan_rules():
    assert reduce_metric("reward", [1.0, NAN, 3.0]) == 2.0
    assert reduce_metric("completions/max_length", [NAN, 5.0, 2.0]) == 5.0
    assert reduce_metric("clip_ratio/low_min", [NAN, 5.0, 2.0]) == 2.0
    assert reduce_metric("tools/x/call_count", [NAN, 2.0, 2.0]) == 4.0
    assert math.isnan(reduce_metric("reward", [NAN, NAN]))
    assert math.isnan(reduce_metric("completions/max_length", [NAN]))


def test_item_mean_is_over_items_not_over_steps():
    w = MetricWindow()
    w.extend("reward", [1.0, 1.0, 1.0])  # step 1: three rollouts
    w.add("reward", 0.0)  # step 2: one rollout
    assert w.reduce()["reward"] == 0.75  # a mean of per-step means would be 0.5


def test_rate_is_ratio_of_sums_not_mean_of_ratios():
    w = MetricWindow()
    w.add_rate("rollout/generated_tokens_per_s", 100, 1.0)  # 100 tok/s over 1 s
    w.add_rate("rollout/generated_tokens_per_s", 100, 4.0)  # 25 tok/s over 4 s
    assert w.reduce()["rollout/generated_tokens_per_s"] == 40.0  # mean of ratios would be 62.5


def test_rate_nan_rules():
    w = MetricWindow()
    w.add_rate("tools/failure_frequency", 0, 0)  # a window with no tool call
    w.add_rate("a/rate", NAN, 1.0)  # ignored pair
    w.add_rate("a/rate", 3.0, 2.0)
    w.add_rate("b/rate", NAN, 1.0)  # every pair NaN
    out = w.reduce()
    assert math.isnan(out["tools/failure_frequency"])
    assert out["a/rate"] == 1.5
    assert math.isnan(out["b/rate"])


def test_gauge_last_value_wins_and_is_not_summed():
    w = MetricWindow()
    w.set_gauge("rollout/queue_size", 7)
    w.set_gauge("rollout/queue_size", 2)
    w.set_gauge("num_tokens", 1000)
    w.set_gauge("num_tokens", 1500)
    out = w.reduce()
    assert out["rollout/queue_size"] == 2
    assert out["num_tokens"] == 1500


def test_keys_without_values_are_not_emitted_and_reset_clears():
    w = MetricWindow()
    w.extend("reward", [])
    w.add("entropy", 0.5)
    assert w.reduce() == {"entropy": 0.5}
    w.reset()
    assert w.reduce() == {} and len(w) == 0


def test_reduce_is_sorted_and_one_name_keeps_one_kind():
    w = MetricWindow()
    w.add("z", 1)
    w.add("a", 2)
    assert list(w.reduce()) == ["a", "z"]
    with pytest.raises(ValueError, match="already recorded as item"):
        w.add_rate("z", 1, 1)
    with pytest.raises(ValueError, match="already recorded as item"):
        w.set_gauge("a", 1)


def test_merge_payloads_from_two_processes():
    rollout = MetricWindow()  # the rollout process
    rollout.extend("reward", [1.0, 0.0, 1.0])
    rollout.add("sample/dropped_stale_count", 2)
    rollout.add("completions/max_length", 50)
    rollout.add_rate("rollout/generated_tokens_per_s", 300, 2.0)
    rollout.set_gauge("rollout/score_queue_size", 4, at=10.0)
    rollout.set_gauge("rollout/queue_size", 9, at=10.0)

    payload = rollout.take_payload()
    assert len(rollout) == 0  # take_payload resets the producer's window
    assert json.loads(json.dumps(payload)) == payload  # plain data only
    received = pickle.loads(pickle.dumps(payload))  # what crosses the multiprocessing queue

    trainer = MetricWindow()
    trainer.add("reward", 1.0)
    trainer.add("sample/dropped_stale_count", 3)
    trainer.add("completions/max_length", 20)
    trainer.add_rate("rollout/generated_tokens_per_s", 100, 2.0)
    trainer.set_gauge("rollout/queue_size", 1, at=20.0)  # newer than the rollout's value
    trainer.merge(received)
    trainer.merge(MetricWindow().to_payload())  # an empty report changes nothing

    out = trainer.reduce()
    assert out["reward"] == 0.75  # (1 + 0 + 1 + 1) / 4 items
    assert out["sample/dropped_stale_count"] == 5
    assert out["completions/max_length"] == 50
    assert out["rollout/generated_tokens_per_s"] == 100.0  # 400 tokens / 4 s
    assert out["rollout/score_queue_size"] == 4
    assert out["rollout/queue_size"] == 1  # the latest gauge wins whatever the merge order


def test_merge_rejects_unknown_sections():
    with pytest.raises(ValueError, match="unknown sections"):
        MetricWindow().merge({"items": {}, "histograms": {}})


def test_metrics_package_imports_no_torch():
    code = (
        "import sys; import asyncgrpo_cli.metrics.logger, asyncgrpo_cli.metrics.reducer; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# -- sinks -------------------------------------------------------------------------------------------------------
def _strict_json(line: str) -> dict:
    def no_constants(c: str):
        raise ValueError(f"non-standard JSON constant {c}")

    return json.loads(line, parse_constant=no_constants)


def test_jsonl_lines_are_valid_json_and_resume_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(1, {"reward": 0.5, "tools/failure_frequency": NAN, "x/max": float("inf")})
    sink.close()
    sink.close()  # idempotent
    sink = JsonlSink(path)  # a resumed run appends to the same file
    sink.log(2, {"reward": 0.25})
    sink.close()

    lines = [_strict_json(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert (
        lines[0]["reward"] == 0.5
        and lines[0]["tools/failure_frequency"] is None
        and lines[0]["x/max"] is None
    )
    assert abs(lines[1]["time"] - time.time()) < 60


def test_jsonl_rejects_metric_named_like_its_fields(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="clash"):
        sink.log(1, {"step": 3.0})
    sink.close()


@pytest.fixture
def no_trackio_dir(monkeypatch):
    """TRACKIO_DIR unset for the test and restored afterwards (the sink exports it for trackio)."""
    monkeypatch.setenv("TRACKIO_DIR", "placeholder")  # records the prior state, so teardown restores it
    monkeypatch.delenv("TRACKIO_DIR")
    monkeypatch.setattr(sinks_mod, "_trackio_dir_we_set", None)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a metrics sink tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.delenv("TRACKIO_SPACE_ID", raising=False)
    monkeypatch.delenv("TRACKIO_SERVER_URL", raising=False)


def _trackio_rows(db: Path) -> list[tuple[str, int, dict]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT run_name, step, metrics FROM metrics ORDER BY step").fetchall()
    return [(run, step, json.loads(m)) for run, step, m in rows]


def test_trackio_writes_into_run_dir_offline_and_resumes(tmp_path, no_trackio_dir, no_network):
    t0 = time.monotonic()
    for step, reward in [(1, 0.5), (2, 0.75)]:  # second sink: a resumed run continues the same trackio run
        sink = TrackioSink("asyncgrpo-test", "run-a", {"trainer": {"max_steps": 2}}, tmp_path / "run")
        assert sink.active
        sink.log(step, {"reward": reward, "tools/failure_frequency": NAN})
        sink.close()
        sink.close()
    assert time.monotonic() - t0 < 20
    db = tmp_path / "run" / "trackio" / "asyncgrpo-test.db"
    rows = _trackio_rows(db)
    assert [(r[0], r[1], r[2]["reward"]) for r in rows] == [("run-a", 1, 0.5), ("run-a", 2, 0.75)]

    # a later run of the same process (multirun) writes into its own run dir
    sink = TrackioSink("asyncgrpo-test", "run-b", {}, tmp_path / "run2")
    sink.log(1, {"reward": 1.0})
    sink.close()
    assert [r[0] for r in _trackio_rows(tmp_path / "run2" / "trackio" / "asyncgrpo-test.db")] == ["run-b"]
    assert os.environ["TRACKIO_DIR"] == str(tmp_path / "run2" / "trackio")


def test_trackio_respects_user_trackio_dir(tmp_path, monkeypatch, no_trackio_dir, no_network):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "mine"))
    sink = TrackioSink("asyncgrpo-test", "run-c", {}, tmp_path / "run")
    sink.log(3, {"reward": 0.1})
    sink.close()
    assert sink.trackio_dir == tmp_path / "mine"
    assert (tmp_path / "mine" / "asyncgrpo-test.db").is_file()
    assert not (tmp_path / "run" / "trackio").exists()


def test_trackio_failure_warns_once_and_never_raises(tmp_path, monkeypatch, caplog, no_trackio_dir):
    monkeypatch.setitem(sys.modules, "trackio", None)  # `import trackio` raises ImportError
    with caplog.at_level(logging.WARNING, logger=sinks_mod.__name__):
        sink = TrackioSink("p", "r", {}, tmp_path)
        sink.log(1, {"reward": 1.0})
        sink.log(2, {"reward": 1.0})
        sink.close()
    assert not sink.active
    warnings = [r for r in caplog.records if "trackio" in r.getMessage()]
    assert len(warnings) == 1 and "continuing without trackio" in warnings[0].getMessage()


# -- console view ------------------------------------------------------------------------------------------------
WINDOW = {
    "reward": 0.5123,
    "frac_reward_zero_std": 0.25,
    "sample/staleness_mean": 0.8,
    "rollout/queue_size": 3.0,
    "perf/wall_clock_trained_tokens_per_s": 12345.6,
    "rollout/generated_tokens_per_s": 3456.7,
    "entropy": 0.41,
    "sampling/importance_sampling_ratio/mean": 1.0021,
}


def _plain_console() -> Console:
    return Console(file=io.StringIO(), width=100)


def test_console_plain_line_per_window():
    console = _plain_console()
    view = ConsoleView("auto", total_steps=10, console=console)  # not a terminal -> plain
    assert view.mode == "plain"
    view.log(3, WINDOW)
    view.log(4, {"reward": 0.25})
    view.close()
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 3/10 ")
    for part in ["reward 0.5123", "groups kept 75%", "staleness 0.8", "queue 3", "train tok/s 12.3k"]:
        assert part in lines[0]
    assert "gen tok/s 3457" in lines[0] and "is_ratio 1.002" in lines[0]
    assert lines[1].startswith("step 4/10 ") and "reward 0.25" in lines[1]


def test_console_without_max_steps_counts_prompts():
    console = _plain_console()
    view = ConsoleView("plain", total_steps=None, total_prompts=1000, console=console)
    view.update_progress(2, prompts_done=120)
    view.log(3, {"reward": 1.0})
    assert "step 3 prompts 120/1000" in console.file.getvalue()
    open_ended = ConsoleView("plain", console=console)  # neither known: no total, no ETA
    open_ended.log(5, {})
    assert console.file.getvalue().splitlines()[-1].startswith("step 5 [")


def test_console_live_stops_on_exception():
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    with pytest.raises(KeyError), ConsoleView("live", total_steps=4, console=console) as view:
        assert view.mode == "live" and console._live_stack
        view.log(1, WINDOW)
        raise KeyError("boom")
    assert not console._live_stack  # no live display left behind
    assert "reward" in console.file.getvalue()


def test_console_live_routes_logging_through_its_console_and_restores_it(monkeypatch):
    """While live, a terminal log handler is swapped for a RichHandler on the view's console (so records print
    above the live region); file handlers stay; close() puts the original handler back."""
    root = logging.getLogger()
    terminal = logging.StreamHandler(sys.stderr)
    to_file = logging.StreamHandler(io.StringIO())  # not a terminal stream: left alone
    monkeypatch.setattr(root, "handlers", [terminal, to_file])
    monkeypatch.setattr(root, "level", logging.INFO)
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    with ConsoleView("live", total_steps=4, console=console) as view:
        (rich,) = [h for h in root.handlers if isinstance(h, RichHandler)]
        assert rich.console is console and terminal not in root.handlers and to_file in root.handlers
        logging.getLogger("asyncgrpo.test").info("saved checkpoint step-000002")
        view.log(1, WINDOW)
    assert root.handlers == [to_file, terminal]
    assert "saved checkpoint step-000002" in Text.from_ansi(console.file.getvalue()).plain
    assert "saved checkpoint" in to_file.stream.getvalue()


def test_live_logging_keeps_a_handler_already_on_the_console(monkeypatch):
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    existing = RichHandler(console=console)
    monkeypatch.setattr(logging.getLogger(), "handlers", [existing])
    routed = LiveLogging(console)
    assert logging.getLogger().handlers == [existing]
    routed.restore()
    assert logging.getLogger().handlers == [existing]


@pytest.mark.parametrize("width", [40, 60, 100, 160])
def test_live_headline_fits_the_width(width):
    console = Console(file=io.StringIO(), force_terminal=True, width=width)
    view = ConsoleView("live", total_steps=4, console=console)
    view.log(2, {**WINDOW, "loss": -0.0123, "sample/dropped_stale_count": 3, "perf/step_s": 38.2})
    with console.capture() as capture:
        console.print(view._render())
    view.close()
    lines = capture.get().splitlines()
    assert max(console.measure(Text.from_ansi(line)).maximum for line in lines) <= width
    cells = " ".join(lines)
    assert all(label in cells for label in ("reward", "groups kept", "stale-dropped", "step_s"))


def test_console_rejects_unknown_mode():
    with pytest.raises(ValueError, match="logging.console"):
        ConsoleView("fancy", console=_plain_console())


def test_print_completions_renders_text_not_markup():
    console = _plain_console()
    view = ConsoleView("plain", console=console)
    view.print_completions(
        [
            {
                "prompt": [{"role": "user", "content": "What is 2+2?"}],
                "completion": "[bold]4[/bold]",
                "reward": 1.0,
            }
        ],
        step=7,
    )
    out = console.file.getvalue()
    assert "completions at step 7" in out and "user: What is 2+2?" in out and "[bold]4[/bold]" in out


# -- logger ------------------------------------------------------------------------------------------------------
def test_logger_rejects_unknown_sink(tmp_path):
    cfg = LoggingConfig(sinks=["console", "wandb"])
    with pytest.raises(ValueError, match=r"logging\.sinks.*'wandb'") as info:
        MetricsLogger(cfg, tmp_path, {}, total_steps=1, total_prompts=None)
    assert all(name in str(info.value) for name in SINK_NAMES)


def test_logger_fans_out_and_closes(tmp_path):
    cfg = LoggingConfig(sinks=["console", "jsonl", "jsonl"], console="plain", log_completions=True)
    cfg.num_completions_to_print = 1
    console = _plain_console()
    samples = [
        {"prompt": "p1", "completion": "c1", "reward": 1.0},
        {"prompt": "p2", "completion": "c2", "reward": 0},
    ]
    with pytest.raises(RuntimeError), MetricsLogger(cfg, tmp_path, {}, 5, None, console=console) as logger:
        w = MetricWindow()
        w.extend("reward", [1.0, 0.0])
        logger.log(1, w.reduce())
        logger.log_completions(samples, step=1)
        raise RuntimeError("training crashed")
    logger.close()  # idempotent after the context manager closed it

    lines = [_strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (
        len(lines) == 1 and lines[0]["step"] == 1 and lines[0]["reward"] == 0.5
    )  # duplicate sink name deduped
    out = console.file.getvalue()
    assert "step 1/5" in out and "reward 0.5" in out and "c1" in out and "c2" not in out
