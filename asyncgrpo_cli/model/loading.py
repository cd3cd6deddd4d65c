"""Loading the policy model and tokenizer for training."""

from __future__ import annotations

import logging
from typing import Any

from asyncgrpo_cli.config.schema import ModelConfig
from asyncgrpo_cli.errors import UserError

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def torch_dtype(name: str) -> Any:
    import torch

    if name == "auto":
        return "auto"
    return getattr(torch, _DTYPES[name])


def is_hybrid_linear_attention(config: Any) -> bool:
    """Qwen3.5 / Qwen3-Next style models mix gated-DeltaNet (linear attention) layers with attention layers."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        layer_types = getattr(cfg, "layer_types", None) or []
        if any("linear" in str(t) for t in layer_types):
            return True
    return False


def load_tokenizer(path: str, cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except OSError as e:
        raise UserError(f"model.name_or_path {path!r}: cannot load the tokenizer ({e}).") from e
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not getattr(tok, "chat_template", None):
        raise UserError(
            f"model.name_or_path {path!r}: the tokenizer has no chat template; prompts are "
            "conversational, so use an instruct/chat model (or one whose tokenizer sets chat_template)."
        )
    return tok


def load_policy(path: str, cfg: ModelConfig, device: Any) -> Any:
    """The trainable causal LM on ``device``, with gradient checkpointing and without a KV cache."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(
            path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except OSError as e:
        raise UserError(
            f"model.name_or_path {path!r} cannot be loaded ({e}); give a hub id, a local directory "
            "saved with save_pretrained, or builtin:tiny-qwen3 / builtin:smollm2-135m-instruct."
        ) from e
    if is_hybrid_linear_attention(config):
        raise UserError(
            f"model.name_or_path {path!r} is a hybrid model with gated-DeltaNet (linear attention) layers; packed "
            "rows would leak state across samples in those layers, and the tree-aware path for them is not "
            "available yet. Use a full-attention model (e.g. Qwen/Qwen3-1.7B)."
        )
    model = AutoModelForCausalLM.from_pretrained(
        path,
        revision=cfg.revision,
        trust_remote_code=cfg.trust_remote_code,
        dtype=torch_dtype(cfg.dtype),
        attn_implementation=cfg.attn_implementation,
    )
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device)
