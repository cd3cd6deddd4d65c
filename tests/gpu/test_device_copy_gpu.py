"""Host-to-GPU copies through pinned memory (``device_copy.py``): a packed row moved while the GPU has work queued
returns before that work is done (a pageable copy would have waited for it) and arrives intact, although its pinned
staging tensors are dropped at once and the host allocates and overwrites pinned memory right after. Skipped
without CUDA."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.device_copy import to_device
from asyncgrpo_cli.packing.tree import TreePacker

pytestmark = pytest.mark.gpu


def _tensors(row) -> dict[str, torch.Tensor]:
    out = {
        f.name: getattr(row, f.name) for f in fields(row) if isinstance(getattr(row, f.name), torch.Tensor)
    }
    for name, extra in row.extras.items():
        out |= {
            f"{name}.{f.name}": v
            for f in fields(extra)
            if isinstance(v := getattr(extra, f.name), torch.Tensor)
        }
    return out


def test_a_row_moved_under_queued_work_does_not_wait_and_arrives_intact():
    from tests.gpu.test_flex_gpu import groups

    cuda = torch.device("cuda", 0)
    row = TreePacker(PackingConfig()).pack(
        groups(np.random.default_rng(0), 4, forks=8, prompt=300, completion=200)
    )
    source = {k: v.clone() for k, v in _tensors(row).items()}
    assert not any(v.is_pinned() for v in source.values())  # pageable, as the packer makes them
    a = torch.randn(8192, 8192, device=cuda, dtype=torch.bfloat16)
    row.to(cuda, non_blocking=True)  # warm the pinned allocator and the copy path
    torch.cuda.synchronize()
    for _ in range(60):  # tens of milliseconds of queued work
        a @ a
    moved = row.to(cuda, non_blocking=True)
    still_busy = not torch.cuda.current_stream().query()
    scribbles = [torch.full((v.numel() + 64,), -7, dtype=v.dtype).pin_memory() for v in source.values()]
    for s in scribbles:
        s.fill_(-9)
    torch.cuda.synchronize()
    assert still_busy  # the host got past the copies while the matmuls were still running
    for name, tensor in _tensors(moved).items():
        assert tensor.is_cuda, name
        assert torch.equal(tensor.cpu(), source[name]), name


def test_to_device_leaves_what_is_not_a_host_to_gpu_copy_to_torch():
    cuda = torch.device("cuda", 0)
    on_gpu = torch.arange(5, device=cuda)
    assert to_device(on_gpu, cuda) is on_gpu
    assert torch.equal(to_device(on_gpu, "cpu"), torch.arange(5))
    pinned = torch.arange(5).pin_memory()
    assert torch.equal(to_device(pinned, cuda).cpu(), pinned)


def test_the_hybrid_plan_of_a_moved_row_never_syncs():
    """The gated-DeltaNet recurrence plan of a row on the GPU is built from the row's host ``leave`` and sent
    through pinned memory: no synchronizing CUDA call (before, it read ``leave`` back from the device)."""
    from types import SimpleNamespace

    from asyncgrpo_cli.model.gdn import PLAN_KWARG, recurrence_kwargs
    from tests.gpu.test_flex_gpu import groups

    cuda = torch.device("cuda", 0)
    row = TreePacker(PackingConfig()).pack(
        groups(np.random.default_rng(1), 2, forks=4, prompt=100, completion=50)
    )
    want = recurrence_kwargs(SimpleNamespace(_asyncgrpo_gdn_taps=4), row)[PLAN_KWARG]
    moved = row.to(cuda, non_blocking=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = recurrence_kwargs(SimpleNamespace(_asyncgrpo_gdn_taps=4), moved)[PLAN_KWARG]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.ancestors.is_cuda
    assert torch.equal(got.ancestors.cpu(), want.ancestors) and torch.equal(
        got.grid_index.cpu(), want.grid_index
    )
