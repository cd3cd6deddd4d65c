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


def _load(name: str):
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.model.resolve import resolve_model_path

    return AutoModelForCausalLM.from_pretrained(resolve_model_path(name))


def test_hybrid_counts_full_attention_layers_and_the_delta_rule_by_hand():
    model = _load("builtin:tiny-qwen3.5")  # 3 gated-DeltaNet layers then 1 attention layer, tied embeddings
    cfg = model.config
    h, inter, v = 128, 256, 1024
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (h, inter, v)
    hk, hv, d, conv = 2, 4, 64, 4  # linear key / value heads, their dims, conv taps
    mlp_norms = 3 * h * inter + 2 * h
    qkv = (2 * hk * d + hv * d) * h
    linear = qkv + hv * d * h + 2 * hv * h + (2 * hk * d + hv * d) * conv + 2 * hv + d + hv * d * h
    # attention: 4 query heads (the output gate doubles q_proj), 2 KV heads of dim 32, q/k norms
    full = 2 * 4 * 32 * h + 2 * (2 * 32 * h) + 4 * 32 * h + 2 * 32
    body = 3 * (linear + mlp_norms) + full + mlp_norms + h
    f = StepFlops(model)
    assert f.body == f.total_body == body and f.experts == 0 and f.head == v * h
    assert f.attn_width == 1 * 4 * 32  # only layer 3 is softmax attention
    c = 64
    assert f.linear == 3 * 3 * hv * (c * (5 * d + 3 * d) + 6 * d * d)
    assert f(100, 40, 3000) == 6 * body * 100 + 6 * v * h * 40 + 12 * 128 * 3000 + f.linear * 100


def test_delta_rule_flops_are_the_chunked_algorithms_matmuls_plus_its_solves():
    """FlopCounterMode counts the matmuls of the pure-torch chunked rule (not its triangular solves): together with
    the two C x C unit-triangular solves they are the forward third of the formula, per token of whole chunks."""
    from types import SimpleNamespace

    from torch.utils.flop_counter import FlopCounterMode

    from asyncgrpo_cli.model.gdn.plan import build_plan
    from asyncgrpo_cli.model.gdn.rule_torch import tree_chunk_gated_delta_rule
    from asyncgrpo_cli.train.flops import gdn_flops_per_token

    n, hk, hv, dk, dv, c = 256, 2, 4, 32, 16, 64
    plan = build_plan(torch.full((n,), n), conv_taps=4)  # one 256-token sample: 4 whole chunks
    args = (torch.randn(n, hk, dk), torch.randn(n, hk, dk), torch.randn(n, hv, dv), -torch.rand(n, hv))
    with FlopCounterMode(display=False) as counter:
        tree_chunk_gated_delta_rule(*args, torch.rand(n, hv), plan)
    solves = (n // c) * hv * c * c * (dk + dv)
    config = SimpleNamespace(
        layer_types=["linear_attention"],
        linear_num_value_heads=hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
    )
    assert 3 * (counter.get_total_flops() + solves) == gdn_flops_per_token(config) * n


def test_moe_counts_the_active_experts_only():
    model = _load("builtin:tiny-qwen3-moe")  # 2 layers, 8 experts of width 64, top 2, tied embeddings
    h, e, k, moe_inter = 128, 8, 2, 64
    attn = 4 * 32 * h + 2 * (2 * 32 * h) + 4 * 32 * h + 2 * 32
    experts = e * (2 * moe_inter * h + h * moe_inter)  # fused gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    other = attn + e * h + 2 * h  # + router [E, H] and the two norms
    f = StepFlops(model)
    assert f.experts == 2 * experts and f.total_body == 2 * (other + experts) + h
    assert f.body == 2 * (other + experts * k // e) + h
    assert f.attn_width == 2 * 4 * 32 and f.linear == 0


def test_qwen3_5_moe_counts_its_shared_expert_and_router_in_full():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen3_5MoeForCausalLM(cfg)
    bank = 4 * (2 * 32 * 64 + 64 * 32)  # routed experts of one layer
    shared = 3 * 48 * 64 + 64  # shared expert + its sigmoid gate [1, H]
    f = StepFlops(model)
    assert f.experts == 4 * bank
    assert f.body == f.total_body - 4 * bank + 4 * bank * 2 // 4
    assert sum(p.numel() for n, p in model.named_parameters() if "shared_expert" in n) == 4 * shared
    assert f.attn_width == 1 * 2 * 32 and f.linear == 3 * 3 * 4 * (64 * (5 * 16 + 3 * 16) + 6 * 16 * 16)
