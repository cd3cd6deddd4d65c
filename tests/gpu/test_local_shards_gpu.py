"""The gradient clip and the AdamW step on FSDP2's local shards on CUDA (one NCCL rank, bf16 mixed precision):
torch's ``clip_grad_norm_`` and fused AdamW on the DTensors bit for bit, queued without a host sync. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo_cli.train.distributed import DistInfo, destroy_distributed, shard_model
from asyncgrpo_cli.train.optim import AdamW, _local_shards, clip_grad_norm
from tests.test_local_shards import _adamw_both_ways, _assert_the_same_steps, _both_ways

pytestmark = pytest.mark.gpu


def _sharded_with_grads():
    from tests.gpu.test_flex_gpu import tiny_qwen3

    model = shard_model(
        tiny_qwen3(torch.float32),
        DistInfo(),
        torch.device("cuda", 0),
        mixed_precision="bfloat16",
        cpu_offload=False,
    )
    params = [p for p in model.parameters()]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for p in params:
        p.grad = p.detach().clone()
        p.grad.to_local().normal_(generator=gen)
    return model, params


def test_the_clip_of_fsdp2_shards_on_cuda_is_torchs_clip_and_never_syncs():
    try:
        model, params = _sharded_with_grads()
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


def test_fused_adamw_on_fsdp2_shards_on_cuda_is_torchs_and_never_syncs():
    try:
        model, params = _sharded_with_grads()
        _, runs = _adamw_both_ways(model, "fused", False)
        opt = AdamW(params, lr=1e-3, fused=True)
        opt.step()
        assert opt.local_groups() is not None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        destroy_distributed()
    _assert_the_same_steps(runs)
