"""The gradient clip on FSDP2's local shards on CUDA (one NCCL rank, bf16 mixed precision): torch's
``clip_grad_norm_`` on the DTensors bit for bit, and queued without a host sync. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo_cli.train.distributed import DistInfo, destroy_distributed, shard_model
from asyncgrpo_cli.train.optim import _local_shards, clip_grad_norm
from tests.test_clip import _both_ways

pytestmark = pytest.mark.gpu


def test_the_clip_of_fsdp2_shards_on_cuda_is_torchs_clip_and_never_syncs():
    from tests.gpu.test_flex_gpu import tiny_qwen3

    cuda = torch.device("cuda", 0)
    try:
        model = shard_model(
            tiny_qwen3(torch.float32), DistInfo(), cuda, mixed_precision="bfloat16", cpu_offload=False
        )
        params = [p for p in model.parameters()]
        gen = torch.Generator(device="cuda").manual_seed(0)
        for p in params:
            p.grad = p.detach().clone()
            p.grad.to_local().normal_(generator=gen)
        assert _local_shards([p.grad for p in params]) is not None
        start, ((norm_t, grads_t), (norm_o, grads_o)) = _both_ways(model, 1.0)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
        try:
            clip_grad_norm(params, 1.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        destroy_distributed()
    assert norm_o.is_cuda and norm_o.item() == norm_t.item() > 1.0
    for ref, got in zip(grads_t, grads_o):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert not torch.equal(grads_o[0], start[0])  # the clip acted
