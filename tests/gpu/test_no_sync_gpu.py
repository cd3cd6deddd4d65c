"""No host sync on CUDA, so the trainer's CPU runs ahead of the GPU and plans the next step under it
(``train/step.py``): the GRPO losses (same metrics as on CPU), and a whole warm training step up to its
``overlap`` hook. Skipped without a CUDA device (the ``gpu`` marker, ``tests/conftest.py``)."""

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


def test_a_training_step_queues_every_row_without_a_host_sync(tmp_path):
    """forward_backward on flex attention, with the trainer's loader and the default head: after a warm-up step
    (compilation and the fused head's first-use check may sync), a step of two tree rows queues both forwards and
    backwards without one synchronizing CUDA call until the ``overlap`` hook, which runs before the loss is read."""
    import numpy as np

    from asyncgrpo_cli.config.schema import ModelConfig, PackingConfig
    from asyncgrpo_cli.model.loading import load_policy
    from asyncgrpo_cli.packing.tree import TreePacker
    from asyncgrpo_cli.train.step import forward_backward
    from tests.gpu.test_flex_gpu import groups, tiny_qwen3

    cuda = torch.device("cuda")
    tiny_qwen3(torch.float32).save_pretrained(tmp_path)
    model = load_policy(str(tmp_path), ModelConfig(name_or_path=str(tmp_path), dtype="bfloat16"), cuda)
    samples = groups(np.random.default_rng(4), 2, forks=8, prompt=100, completion=20)
    rows = [samples[:8], samples[8:]]
    num_trained = sum(s.num_trained for s in samples)
    step = lambda overlap=None: forward_backward(  # noqa: E731
        model,
        rows,
        num_trained,
        TreePacker(PackingConfig()),
        ClippedLoss(LossConfig()),
        cuda,
        1.0,
        overlap=overlap,
    )
    step()  # warm-up
    torch.cuda.synchronize()
    modes = []

    def leave_debug_mode():
        modes.append(torch.cuda.get_sync_debug_mode())
        torch.cuda.set_sync_debug_mode("default")

    torch.cuda.set_sync_debug_mode("error")
    try:
        res = step(leave_debug_mode)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert modes == [2]  # the hook ran, still in "error" mode: nothing synchronized before it
    assert np.isfinite(res.loss) and res.fwd_s > 0 and res.fwd_bwd_s > res.fwd_s
