"""End to end, the way users run it: `asyncgrpo train +recipe=tiny ...` in a subprocess, embedded server and all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REFERENCE_METRICS = [
    "reward",
    "reward_kept",
    "reward_group_std",
    "frac_reward_zero_std",
    "rewards/digits/mean",
    "rewards/digits/group_std",
    "entropy",
    "num_tokens",
    "completions/mean_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/duplicate_frac",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/max",
    "sampling/masked_mean",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/sampler_mass",
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "rollout/duration_s",
    "rollout/generated_tokens_per_s",
    "rollout/concurrency",
    "rollout/queue_size",
    "rollout/score_s",
    "sample/staleness_mean",
    "sample/staleness_max",
    "sample/time_in_queue_s",
    "batch/trained_tokens_per_step",
    "batch/forwarded_tokens_per_step",
    "batch/samples_per_row",
    "batch/row_fill_frac",
    "batch/packing_ratio",
    "perf/step_s",
    "perf/fwd_bwd_s",
    "perf/optimizer_s",
    "perf/rollout_wait_s",
    "perf/plan_s",
    "perf/plan_overlapped_s",
    "perf/handout_s",
    "perf/weight_sync_s",
    "perf/wall_clock_trained_tokens_per_s",
]


def train(*overrides: str, timeout: float = 240, multirun: bool = False) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        "-m",
        "asyncgrpo_cli",
        "train",
        *(["-m"] if multirun else []),
        "+recipe=tiny",
        "logging.console=plain",
        *overrides,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_metrics_checkpoint_and_resumes(tmp_path):
    run = tmp_path / "run"
    out = train("trainer.max_steps=3", "trainer.save_steps=2", f"hydra.run.dir={run}")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    seen = set().union(*rows)
    missing = [m for m in REFERENCE_METRICS if m not in seen]
    assert not missing, missing
    assert rows[-1]["model_version"] == 3  # one sync per step
    # step 1 trains what version 0 generated; the samples planned during it for step 2 are logged with step 2
    assert rows[0]["sample/staleness_max"] == 0
    assert rows[-1]["num_tokens"] > rows[0]["num_tokens"] > 0
    assert (run / "resolved.yaml").is_file()
    ckpts = sorted((run / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-000002", "step-000003"]
    state = json.loads((ckpts[-1] / "rollout_state.json").read_text())
    assert state["model_version"] == 3 and state["prompt_index"] >= 1 and state["trained_prompt_count"] >= 3
    assert (ckpts[-1] / "dcp" / ".metadata").is_file()  # sharded model + optimizer state
    assert (ckpts[-1] / "model" / "config.json").is_file()  # the policy as an HF model directory
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(ckpts[-1] / "model").config.model_type == "qwen3"

    out = train("trainer.max_steps=5", "trainer.resume=auto", f"hydra.run.dir={run}")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["model_version"] == 5 and rows[-1]["num_tokens"] > rows[2]["num_tokens"]
    resumed = json.loads((run / "checkpoints" / "step-000005" / "rollout_state.json").read_text())
    assert resumed["trained_prompt_count"] > state["trained_prompt_count"]
    assert resumed["prompt_index"] >= state["prompt_index"]


def test_weights_synced_every_other_step_plan_each_step_at_its_version(tmp_path):
    """The next step is planned while this one's GPU work runs, at the version it trains at: with a sync every
    second step that version advances every other step (a wrong guess would stop the run in collect). Steps 2-3
    are recorded by trainer.profile (one trace of both, with the weight sync that ends step 2)."""
    run = tmp_path / "every-other"
    out = train(
        "trainer.max_steps=4",
        "trainer.save_steps=0",
        "rollout.weight_sync_steps=2",
        "trainer.profile.steps=[2,3]",
        f"hydra.run.dir={run}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(run)
    assert [(r["step"], r["model_version"]) for r in rows] == [(1, 0), (2, 1), (3, 1), (4, 2)]
    assert all(
        r["perf/plan_overlapped_s"] >= 0 and r["perf/plan_s"] >= 0 and r["perf/handout_s"] >= 0 for r in rows
    )
    assert sorted(p.name for p in (run / "profile").iterdir()) == [
        "steps-2-3-rank-0.json.gz",
        "steps-2-3-rank-0.txt",
    ]
    text = (run / "profile" / "steps-2-3-rank-0.txt").read_text()
    assert text.startswith("steps 2-3 on cpu: wall ") and "| matmul |" in text


def test_multirun_sweep_jobs_start_clean(tmp_path):
    sweep = tmp_path / "sweep"
    out = train(
        "rollout.max_staleness=0,2",
        "trainer.max_steps=2",
        "trainer.save_steps=0",
        f"hydra.sweep.dir={sweep}",
        multirun=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for job, staleness in (("0", 0), ("1", 2)):
        rows = read_metrics(sweep / job)
        assert [r["step"] for r in rows] == [1, 2]
        resolved = (sweep / job / "resolved.yaml").read_text()
        assert f"max_staleness: {staleness}" in resolved


def test_epoch_based_run_stops_after_one_pass(tmp_path):
    run = tmp_path / "epochs"
    out = train(
        "trainer.max_steps=-1",
        "trainer.num_train_epochs=1",
        "data.num_examples=6",
        "trainer.save_steps=0",
        f"hydra.run.dir={run}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (ckpt,) = (run / "checkpoints").iterdir()
    state = json.loads((ckpt / "rollout_state.json").read_text())
    assert state["trained_prompt_count"] == 6 and state["prompt_index"] == 6


def test_rollout_crash_stops_training_with_its_traceback(tmp_path):
    t0 = time.monotonic()
    out = train(
        "rewards.funcs=[tests.helpers.bad_rewards:exploding_reward]",
        f"hydra.run.dir={tmp_path / 'r'}",
        timeout=180,
    )
    assert out.returncode == 1
    # One line names the function and the row; the tracebacks (trainer's and rollout process's) go to error.log.
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("asyncgrpo: error:")]
    assert "exploding_reward" in line and "reward exploded on purpose" in line and "dataset row" in line
    assert "Traceback" not in out.stderr
    assert "rollout process traceback" in (tmp_path / "r" / "error.log").read_text()
    assert time.monotonic() - t0 < 120


def test_unreachable_server_fails_fast_with_the_key(tmp_path):
    t0 = time.monotonic()
    out = train(
        "server=vllm",
        "server.base_url=http://127.0.0.1:9",
        "server.startup_timeout=3",
        f"hydra.run.dir={tmp_path / 'r'}",
        timeout=120,
    )
    assert out.returncode != 0
    assert "http://127.0.0.1:9" in out.stderr and "server.startup_timeout=3" in out.stderr
    assert "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 60


def test_missing_prompt_column_names_the_columns(tmp_path):
    out = train("data.prompt_column=question", f"hydra.run.dir={tmp_path / 'r'}", timeout=120)
    assert out.returncode != 0
    assert "data.prompt_column 'question' is not a column" in out.stderr and "prompt, task_id" in out.stderr


def test_busy_port_names_the_key(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        out = train(f"server.embedded.port={port}", f"hydra.run.dir={tmp_path / 'r'}", timeout=120)
    assert out.returncode != 0
    assert "server.embedded.port" in out.stderr and str(port) in out.stderr
    assert "Traceback" not in out.stderr


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_every_process_the_run_started(tmp_path):
    run = tmp_path / "r"
    args = [
        sys.executable,
        "-m",
        "asyncgrpo_cli",
        "train",
        "+recipe=tiny",
        "logging.console=plain",
        "trainer.max_steps=10000",
        "trainer.save_steps=0",
        "trainer.save_final=false",
        f"hydra.run.dir={run}",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (run / "metrics.jsonl").is_file(), "training never logged a step"
        children = _children(proc.pid)
        assert len(children) >= 2  # embedded server, rollout process (and the resource tracker)
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # the run prints every thread's stack (cli._stacks_on_sigusr1)
            time.sleep(2)
            proc.kill()
            _, err = proc.communicate(timeout=30)
            pytest.fail(
                f"the run did not stop within 60 s of SIGTERM; its stderr, stacks last:\n{err[-8000:]}"
            )
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert "terminated" in err
    time.sleep(1)
    assert [c for c in children if _alive(c)] == []
