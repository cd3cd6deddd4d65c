"""CUDA: trainer.profile's summary counts each kernel once (the profiler also lists the CPU operators and
``record_function`` ranges that span kernels), so a step's kernel time stays within its wall time."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo_cli.config.schema import ProfileConfig
from asyncgrpo_cli.train.profiler import StepProfiler

pytestmark = pytest.mark.gpu


def test_kernel_time_is_counted_once_and_matmuls_are_named(tmp_path):
    device = torch.device("cuda", 0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048)).to(
        device
    )
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(4096, 2048, device=device)
    prof = StepProfiler(ProfileConfig(steps=[2, 3]), tmp_path, rank=0, device=device)
    for step in range(1, 4):
        prof.before(step)
        for _ in range(4):
            model(x).square().mean().backward()
        opt.step()  # a record_function range ("Optimizer.step#AdamW.step") over the fused kernel
        opt.zero_grad()
        prof.after(step)
    text = (tmp_path / "steps-2-3-rank-0.txt").read_text()
    first = text.splitlines()[0]
    share = float(first.rsplit("(", 1)[1].split("%")[0])
    assert 30 < share <= 100, first  # the GPU is busy, and nothing is counted twice
    assert "| matmul |" in text and "| optimizer |" in text, text
    assert "Optimizer.step#AdamW.step" not in text, text
