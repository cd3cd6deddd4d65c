"""Model shapes the GPU benchmarks build with random weights (no hub download) and the peak they measure MFU
against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PEAK_BF16_TFLOPS = 989.0
"""H100 / H200 SXM dense bf16 peak, TFLOP/s."""

QWEN3_BASE: dict[str, Any] = {
    "model_type": "qwen3",
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
"""Qwen3Config keyword arguments of the Qwen3-0.6B and Qwen3-1.7B architectures (``model_type`` picks the class)."""

HYBRID_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
QWEN3_5_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3.5-2b": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "layer_types": HYBRID_LAYER_TYPES * 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
        },
    },
    "tiny-qwen3.5": {
        "model_type": "qwen3_5_text",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": HYBRID_LAYER_TYPES,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
    },
}
"""Qwen3_5TextConfig keyword arguments: Qwen3.5-2B's text decoder (hidden 2048, 24 layers of 3 gated-DeltaNet :
1 gated attention, 8 query / 2 KV heads of dim 256, DeltaNet 16 key / 16 value heads of dim 128, conv 4, MLP 6144,
vocabulary 248,320, tied embeddings, rope theta 1e7 on a quarter of each head) and a tiny hybrid for CPU smoke
tests. Qwen3.5-2B's multi-token-prediction layer and vision tower are not part of a text training step."""


SHAPES: dict[str, dict[str, Any]] = {
    **QWEN3_SHAPES,
    **QWEN3_5_SHAPES,
    "tiny": {
        "model_type": "qwen3",
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "vocab_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
        "hidden_size": 128,
        "intermediate_size": 256,
    },
}
"""Every shape the GPU benchmarks take by name (``shapes=``): Qwen3, the hybrid, and a tiny Qwen3 for CPU smoke
tests."""


def shape_config(shape: dict[str, Any], **overrides: Any) -> Any:
    """The transformers config of a shape (its ``model_type`` picks the class), with ``overrides``."""
    from transformers import AutoConfig

    kwargs = {**shape, **overrides}
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def weightless_checkpoint(shape: dict[str, Any], path: Path) -> str:
    """config.json plus an empty safetensors file at ``path``: ``model/loading.py:load_policy`` then builds the
    model as training does (attention resolution, packed linear attention, checkpointing) with every weight
    initialized at random, and nothing is downloaded."""
    from safetensors.torch import save_file

    shape_config(shape).save_pretrained(path)
    save_file({}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


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
