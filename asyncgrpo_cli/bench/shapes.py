"""Model shapes the GPU benchmarks build with random weights (no hub download) and the peak they measure MFU
against."""

from __future__ import annotations

from typing import Any

PEAK_BF16_TFLOPS = 989.0
"""H100 / H200 SXM dense bf16 peak, TFLOP/s."""

QWEN3_BASE: dict[str, Any] = {
    "vocab_size": 151936,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
}
QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": {**QWEN3_BASE, "hidden_size": 1024, "intermediate_size": 3072},
    "1.7b": {**QWEN3_BASE, "hidden_size": 2048, "intermediate_size": 6144},
}
"""Qwen3Config keyword arguments of the Qwen3-0.6B and Qwen3-1.7B architectures."""


def serving_model(shape: str) -> Any:
    """A random model of the embedded-server bench's ``shape`` (``smollm2``: SmolLM2-135M's; else a tiny Qwen3)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if shape == "smollm2":
        cfg = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
            eos_token_id=2,
        )
        return LlamaForCausalLM(cfg).eval()
    cfg = Qwen3Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        eos_token_id=2,
    )
    return Qwen3ForCausalLM(cfg).eval()
