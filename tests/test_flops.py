"""The step FLOP count behind perf/mfu_*: attended pairs from a packed row's intervals, and the formula's terms."""

from __future__ import annotations

import numpy as np
import torch

from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.samples import TrainingSequence
from asyncgrpo_cli.train.flops import PEAK_BF16_TFLOPS, StepFlops, attended_pairs, peak_tflops


def _sample(n: int) -> TrainingSequence:
    mask = np.zeros(n, dtype=bool)
    mask[1:] = True
    return TrainingSequence(np.arange(n) + 5, mask, np.where(mask, -0.1, 0.0).astype(np.float32))


def test_a_sequence_row_attends_its_causal_triangles():
    row = SequencePacker(PackingConfig(kind="sequence")).pack([_sample(3), _sample(5)])
    assert attended_pairs(row.leave) == 3 * 4 // 2 + 5 * 6 // 2


def test_step_flops_counts_body_head_and_attention():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg)
    f = StepFlops(model)
    body = sum(p.numel() for p in model.parameters()) - 64 * 32  # tied: one embedding matrix
    assert f.body == body and f.head == 64 * 32 and f.attn_width == 2 * 4 * 8
    assert f(10, 4, 30) == 6 * body * 10 + 6 * 64 * 32 * 4 + 12 * 64 * 30


def test_no_mfu_without_a_known_peak():
    assert peak_tflops(torch.device("cpu"), "bfloat16") is None
    assert PEAK_BF16_TFLOPS["H200"] == 989.0
