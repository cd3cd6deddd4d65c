"""CUDA: the trainer's step path with ``trainer.compile=auto`` (the default, on for CUDA) over rows of six lengths:
``load_policy`` (flex attention, gradient checkpointing), ``maybe_compile_decoder_layers``, FSDP2 (``shard_model``
with bf16 mixed precision over a one-rank group), ``forward_backward`` and ``clip_and_step``, for tree and sequence
packing, LoRA and the gated-DeltaNet hybrid. After the first two row lengths nothing compiles again (dynamo's
graph count and the compile meter), the first step's compile time is measured, and the compiled step's loss is the
eager one's. Run with ``-rP`` to see each case's lengths, graph counts and compile seconds per step."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.compiled_steps import run_steps

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)  # FSDP2 needs an indexed device (the trainer passes cuda:LOCAL_RANK)


@pytest.mark.parametrize(
    "model,packing,lora",
    [
        ("builtin:tiny-qwen3", "tree", False),
        ("builtin:tiny-qwen3", "sequence", False),
        ("builtin:tiny-qwen3", "tree", True),
        ("builtin:tiny-qwen3.5", "tree", False),
    ],
)
def test_the_compiled_training_path_stops_compiling_after_two_row_lengths(model, packing, lora):
    steps = run_steps(CUDA, "auto", model=model, packing=packing, mixed_precision="bfloat16", lora=lora)
    print(
        f"{model} packing={packing} lora={lora}: lengths {steps.lengths}, graphs {steps.graphs}, compile s "
        f"{[round(s, 2) for s, _ in steps.compiles]}, compiles {[n for _, n in steps.compiles]}, step s "
        f"{[round(s, 2) for s in steps.step_s]}, graph breaks {steps.graph_breaks}"
    )
    n = len(steps.lengths)
    assert len(set(steps.lengths)) == n, steps.lengths
    assert steps.graphs[0] > 0  # auto compiled on CUDA
    if (
        model == "builtin:tiny-qwen3"
    ):  # whole layers compile (the hybrid's packed DeltaNet forward runs eagerly)
        assert steps.graph_breaks == []
    assert steps.graphs[2:] == [steps.graphs[1]] * (n - 2), steps.graphs
    seconds, count = steps.compiles[0]
    assert count > 0 and 0 < seconds <= steps.step_s[0]
    assert steps.compiles[2:] == [(0.0, 0)] * (n - 2), steps.compiles
    assert all(math.isfinite(loss) for loss in steps.losses)
    assert all(math.isfinite(g) and g > 0 for g in steps.grad_norms)


def test_the_compiled_step_trains_like_eager():
    """Same weights, same rows: the first step's loss compiled equals eager's (bf16 compute), and so do the next
    steps' within bf16 drift."""
    compiled = run_steps(CUDA, True, mixed_precision="bfloat16")
    eager = run_steps(CUDA, False, mixed_precision="bfloat16")
    assert compiled.lengths == eager.lengths
    assert all(loss != 0 for loss in eager.losses)
    assert compiled.losses[0] == pytest.approx(eager.losses[0], rel=2e-2, abs=1e-2)
    assert compiled.losses == pytest.approx(eager.losses, rel=5e-2, abs=2e-2)
    assert compiled.grad_norms == pytest.approx(eager.grad_norms, rel=5e-2)
