"""The GRPO losses queue their work without a host sync on CUDA (so the trainer's CPU runs ahead of the GPU and
plans the next step under it, ``train/step.py``), and give the same metrics as on CPU."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo_cli.config.schema import LossConfig
from asyncgrpo_cli.model.logprobs import TokenStats
from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK
from asyncgrpo_cli.train.losses import ClippedLoss, ScoreCenteringLoss, finalize_metrics
from tests.test_losses import clipped_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("loss_cls", [ClippedLoss, ScoreCenteringLoss])
def test_a_loss_and_its_metrics_never_sync_the_host(loss_cls):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    logp, row, entropy = clipped_inputs()  # sample 2 of the row has no trained token
    n = logp.shape[0]
    gen = torch.Generator().manual_seed(0)
    row.extras[SAMPLER_TOPK] = TopK(  # the sampler's top-2, one of them padding on the last token
        torch.tensor([[3, 4]] * (n - 1) + [[5, -1]]), -torch.rand(n, 2, generator=gen) * 3
    )
    topk = -torch.rand(n, 2, generator=gen) * 3
    loss_fn = loss_cls(LossConfig(epsilon=0.2))
    cpu_stats = TokenStats(logprobs=logp, entropy=entropy, topk_logprobs=topk)
    cpu_loss, cpu_raw = loss_fn(cpu_stats, row, num_trained_step=10)
    cuda_row = row.to("cuda")
    cuda_logp = logp.detach().cuda().requires_grad_(True)
    stats = TokenStats(
        logprobs=cuda_logp, entropy=entropy.cuda(), topk_logprobs=topk.cuda().requires_grad_(True)
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        loss, raw = loss_fn(stats, cuda_row, num_trained_step=10)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert loss.item() == pytest.approx(cpu_loss.item(), abs=1e-6)
    assert finalize_metrics(raw) == pytest.approx(finalize_metrics(cpu_raw))
