"""End to end, the way users run it: `asyncgrpo distill +recipe=distill_tiny ...` in a subprocess, with an embedded
student server and embedded teachers (tiny random models that share a tokenizer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DISTILL_METRICS = [
    "jsd",
    "entropy",
    "teacher_entropy",
    "teacher_logprob",
    "teacher_jsd/default",
    "teacher_entropy/default",
    "teacher_token_frac/default",
    "teacher_score_s/default",
    "loss",
    "rollout/score_s",
    "rollout/duration_s",
    "rollout/generated_tok_s",
    "rollout/inflight",
    "sample/rollout_queue_size",
    "sample/time_in_queue_s",
    "sample/staleness_mean",
    "batch/masked_token_frac",
    "batch/row_imbalance",
    "batch/row_fill_frac",
    "batch/samples_per_step",
    "batch/samples_per_row",
    "completions/mean_length",
    "completions/clipped_ratio",
    "perf/fwd_bwd_s",
    "perf/fwd_s",
    "perf/step_s",
    "perf/optimizer_s",
    "perf/rollout_wait_s",
    "perf/weight_sync_s",
    "perf/forwarded_tok_s_fwd_bwd",
    "perf/forwarded_tok_s_wall_clock",
    "perf/trained_tok_s_wall_clock",
]


def distill(*overrides: str, timeout: float = 300, multirun: bool = False, verb: str = "distill"):
    args = [
        sys.executable,
        "-m",
        "asyncgrpo_cli",
        verb,
        *(["-m"] if multirun else []),
        "+recipe=distill_tiny",
        "logging.console=plain",
        *overrides,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_distill_logs_the_reference_metrics_checkpoints_and_resumes(tmp_path):
    run = tmp_path / "run"
    out = distill("trainer.max_steps=3", "trainer.save_steps=3", f"hydra.run.dir={run}")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    seen = set().union(*rows)
    missing = [m for m in DISTILL_METRICS if m not in seen]
    assert not missing, missing
    assert not any(k.endswith("_count") for k in seen), sorted(k for k in seen if k.endswith("_count"))
    assert all(r["jsd"] > 0 for r in rows) and all(r["teacher_token_frac/default"] == 1.0 for r in rows)
    assert (run / "teacher_default.log").is_file()
    state = json.loads((run / "checkpoints" / "step-000003" / "rollout_state.json").read_text())
    assert state["model_version"] == 3 and state["trained_prompt_count"] >= 3

    out = distill("trainer.max_steps=5", "trainer.resume=auto", f"hydra.run.dir={run}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5]
    resumed = json.loads((run / "checkpoints" / "step-000005" / "rollout_state.json").read_text())
    assert resumed["trained_prompt_count"] > state["trained_prompt_count"]
    assert resumed["prompt_index"] >= state["prompt_index"]


MOPD = [
    "~teacher.servers.default",  # the recipe's one teacher
    # 'same' serves the student's own initial weights, 'other' different ones: their JSDs must tell them apart
    "+teacher.servers.same={backend: embedded, model: 'builtin:tiny-qwen3'}",
    "+teacher.servers.other={backend: embedded, model: 'builtin:tiny-qwen3-teacher'}",
    "data.num_examples=16",
    "++data.columns={teacher_id: same}",
    "data.mix=[{columns: {teacher_id: other}}]",
]


def test_mopd_routes_rows_to_their_teacher_in_a_multirun_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    out = distill(
        *MOPD,
        "loss.beta=0,1",
        "trainer.max_steps=3",
        "trainer.save_steps=0",
        "trainer.save_final=false",
        "trainer.learning_rate=0",  # the student keeps its initial weights: 'same' stays its twin
        f"hydra.sweep.dir={sweep}",
        multirun=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for job, beta in (("0", "0.0"), ("1", "1.0")):
        assert f"beta: {beta}" in (sweep / job / "resolved.yaml").read_text()
        rows = read_metrics(sweep / job)
        assert [r["step"] for r in rows] == [1, 2, 3]
        for r in rows:  # a step may hold one teacher's rows only: its share is then 1 and the other is absent
            fracs = [r.get("teacher_token_frac/same", 0.0), r.get("teacher_token_frac/other", 0.0)]
            assert sum(fracs) == pytest.approx(1.0), r
        both = [r for r in rows if "teacher_jsd/same" in r and "teacher_jsd/other" in r]
        assert both, rows
        for r in both:
            assert r["teacher_jsd/same"] < 0.05 * r["teacher_jsd/other"], r
        seen = set().union(*rows)  # rollout-side timings land in the window their scoring call finished in
        assert {"teacher_score_s/same", "teacher_score_s/other"} <= seen


def test_bad_distillation_input_gets_one_message_naming_the_key(tmp_path):
    out = distill(*MOPD[:3], f"hydra.run.dir={tmp_path / 'a'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "no 'teacher_id' column (teacher.id_column)" in out.stderr
    out = distill("loss.beta=1.5", f"hydra.run.dir={tmp_path / 'b'}")
    assert out.returncode == 2 and "loss.beta (1.5) must be in [0, 1]" in out.stderr
    out = distill("trainer.max_steps=1", verb="train")
    assert out.returncode == 2 and "run it with `asyncgrpo distill +recipe=distill_tiny`" in out.stderr


def test_an_unreachable_teacher_is_named_within_its_timeout(tmp_path):
    t0 = time.monotonic()
    out = distill(
        "teacher.servers.default=http://127.0.0.1:9",
        "teacher.startup_timeout=3",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "teacher 'default' at http://127.0.0.1:9" in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - t0 < 120
    assert not (tmp_path / "run" / "checkpoints").exists()
