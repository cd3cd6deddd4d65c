"""FSDP2 on several GPUs (NCCL) with the tiny model: N ranks equal one process, DCP checkpoints resume on another
world size, and bf16 mixed precision / CPU offload train and gather full weights.

Each case launches ``tests/helpers/dist_equivalence.py`` (one process, or torchrun with N ranks) with a timeout;
a launch that overruns has its whole process group killed. Skipped without CUDA or with fewer than N GPUs.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.dist, pytest.mark.slow]
HELPER = str(Path(__file__).parent.parent / "helpers" / "dist_equivalence.py")
LAUNCH_TIMEOUT_S = 240
COUNTS = [2, 4]


def launch(model_dir: Path, out: Path, *args: str, nproc: int = 1) -> dict:
    """Run the helper (torchrun when ``nproc`` > 1) on CUDA and return what rank 0 saved."""
    runner = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    )
    cmd = [*runner, HELPER, "--model", str(model_dir), "--out", str(out), "--device", "cuda", *args]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }
    # its own session and process group, so a timeout ends torchrun and every rank
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[-12:])} ran past {LAUNCH_TIMEOUT_S} s:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-4000:]
    return torch.load(out, weights_only=False)


def need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, {torch.cuda.device_count()} visible")


def max_change(params: dict, model_dir: Path) -> float:
    """Largest change of any weight from the model's initial weights (proof that the steps trained)."""
    from safetensors.torch import load_file

    init = load_file(str(model_dir / "model.safetensors"))
    return max(float((params[k] - init[k]).abs().max()) for k in init)


def assert_params_close(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> dict:
    """One process, fp32, three steps of every row count the parametrized cases use, keyed by row count."""
    need_gpus(2)
    tmp = tmp_path_factory.mktemp("reference")
    return {
        rows: launch(tiny_model_dir, tmp / f"{rows}.pt", "--steps", "3", "--rows", str(rows))
        for rows in COUNTS
        if torch.cuda.device_count() >= rows
    }


@pytest.mark.parametrize("n", COUNTS)
def test_ranks_match_one_process_and_resume_on_another_world_size(tiny_model_dir, tmp_path, reference, n):
    need_gpus(n)
    ref = reference[n]
    run = tmp_path / "run"
    two = launch(tiny_model_dir, tmp_path / "n.pt", "--rows", str(n), "--save", str(run), nproc=n)
    assert two["world_size"] == n
    assert two["losses"] == pytest.approx(ref["losses"][:2], abs=1e-5)
    assert_params_close(two["params_by_step"][2], ref["params_by_step"][2])
    assert max_change(two["params"], tiny_model_dir) > 1e-3
    # DCP reshards the N-rank checkpoint (model and AdamW state) onto half as many ranks; step 3 then matches
    ckpt = run / "checkpoints" / "step-000002"
    third = launch(
        tiny_model_dir,
        tmp_path / "resumed.pt",
        "--rows",
        str(n),
        "--steps",
        "1",
        "--resume",
        str(ckpt),
        nproc=n // 2,
    )
    assert third["world_size"] == n // 2
    assert third["losses"] == pytest.approx(ref["losses"][2:], abs=1e-5)
    assert_params_close(third["params_by_step"][3], ref["params_by_step"][3])


@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("mode", ["bf16", "cpu_offload"])
def test_mixed_precision_and_cpu_offload_train_and_gather_full_weights(
    tiny_model_dir, tmp_path, reference, n, mode
):
    need_gpus(n)
    ref = reference[n]
    flags = ["--mixed-precision", "bfloat16"] if mode == "bf16" else ["--cpu-offload"]
    got = launch(tiny_model_dir, tmp_path / f"{mode}.pt", "--rows", str(n), "--check-gather", *flags, nproc=n)
    assert all(math.isfinite(x) for x in got["losses"])
    assert got["gather"]["dtypes"] == ["torch.float32"]  # fp32 master weights, gathered at full shape
    assert got["shard_devices"] == (["cpu"] if mode == "cpu_offload" else ["cuda"])
    if mode == "bf16":  # bf16 compute: close to the fp32 run, not equal to it
        assert got["losses"][0] == pytest.approx(ref["losses"][0], abs=0.05 * max(1.0, abs(ref["losses"][0])))
        assert max_change(got["params"], tiny_model_dir) > 1e-3
    else:  # fp32 with AdamW on the CPU: the same steps as one process on the GPU
        assert got["losses"] == pytest.approx(ref["losses"][:2], abs=1e-5)
        assert_params_close(got["params"], ref["params_by_step"][2])
