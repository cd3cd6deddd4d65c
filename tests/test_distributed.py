"""Several trainer ranks on CPU (gloo) with the tiny model: exact equivalence, save/resume across world sizes,
and a failing rank stopping every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]
HELPERS = Path(__file__).parent / "helpers"


def torchrun(*args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        *args,
    ]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize("loss", ["score_centering", "clipped", "hybrid"])
def test_two_ranks_match_one_process(tiny_model_dir, tmp_path, loss):
    """Two optimizer steps: FSDP2 on 2 ranks (one row each) == one process (the rows as 2 micro-batches).
    ``hybrid``: the tiny Qwen3.5 gated-DeltaNet hybrid (its packed forward under FSDP2), default loss."""
    if loss == "hybrid":
        from asyncgrpo_cli.model.resolve import resolve_model_path

        tiny_model_dir, loss = resolve_model_path("builtin:tiny-qwen3.5"), "score_centering"
    script = str(HELPERS / "dist_equivalence.py")
    one = subprocess.run(
        [
            sys.executable,
            script,
            "--model",
            str(tiny_model_dir),
            "--out",
            str(tmp_path / "1.pt"),
            "--loss",
            loss,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # the ranks' threading: the same kernels, the same sums
    )
    assert one.returncode == 0, one.stderr[-2000:]
    two = torchrun(script, "--model", str(tiny_model_dir), "--out", str(tmp_path / "2.pt"), "--loss", loss)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert a["losses"] == pytest.approx(b["losses"], abs=1e-6)
    # the clip's norm is reduced over both ranks' shards (it is over max_grad_norm=1: the clip acts)
    assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-5)
    assert a["grad_norms"][0] > 1.0
    assert set(a["params"]) == set(b["params"])
    from safetensors.torch import load_file

    init = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    assert max(float((a["params"][k] - init[k]).abs().max()) for k in init) > 1e-3  # the steps did train
    for name in a["params"]:
        torch.testing.assert_close(a["params"][name], b["params"][name], atol=5e-5, rtol=1e-4)


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_train_save_and_resume_on_another_world_size(tmp_path):
    run = tmp_path / "run"
    base = ["-m", "asyncgrpo_cli", "train", "+recipe=tiny", "logging.console=plain", f"hydra.run.dir={run}"]
    out = torchrun(*base, "trainer.max_steps=2", "trainer.save_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = run / "checkpoints" / "step-000002"
    assert {"rng-0.pt", "rng-1.pt", "dcp", "model", "rollout_state.json"} <= {p.name for p in ckpt.iterdir()}
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2
    # resume with one process: DCP reshards the 2-rank checkpoint
    out = subprocess.run(
        [sys.executable, *base, "trainer.max_steps=3", "trainer.resume=auto"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert _steps(run) == [1, 2, 3]
    # and back to two ranks
    out = torchrun(*base, "trainer.max_steps=4", "trainer.resume=auto")
    assert out.returncode == 0, out.stderr[-3000:]
    assert _steps(run) == [1, 2, 3, 4]
    state = json.loads((run / "checkpoints" / "step-000004" / "rollout_state.json").read_text())
    assert state["model_version"] == 4


def test_one_failing_rank_stops_every_rank_with_its_error(tmp_path):
    t0 = time.monotonic()
    out = torchrun(
        "-m",
        "asyncgrpo_cli",
        "train",
        "+recipe=tiny",
        "logging.console=plain",
        "loss.name=tests.helpers.rank_fail:FailsOnRankOne",
        "trainer.max_steps=50",
        f"hydra.run.dir={tmp_path / 'r'}",
        timeout=240,
    )
    assert out.returncode != 0
    assert "rank 1 failed on purpose" in out.stderr + out.stdout
    assert time.monotonic() - t0 < 120
