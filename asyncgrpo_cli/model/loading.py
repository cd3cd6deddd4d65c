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
    """Qwen3.5 / Qwen3-Next style models mix gated-DeltaNet (linear attention) layers with attention layers.

    Packed rows are refused for them, whatever ``packing.kind``: those layers run a causal convolution and a
    recurrence over the whole row, and neither a 4D mask nor position-id resets reach them (transformers hands
    them no mask for a 4D one, and its torch fallback ignores ``cu_seq_lens``), so sequence packing leaks state
    from one sample into the next just as tree packing would.
    """
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
    """The trainable causal LM on ``device``, with gradient checkpointing and without a KV cache.

    ``model.attn_implementation`` is resolved for ``device`` (``auto``: flex attention on CUDA, SDPA elsewhere;
    see ``model/flex.py``).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncgrpo_cli.model.flex import resolve_attn_implementation

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
            f"model.name_or_path {path!r} is a hybrid model with gated-DeltaNet (linear attention) layers. Both "
            "packers put several samples in one row, and those layers run their convolution and recurrent state "
            "across the whole row (no mask or position reset reaches them), so samples would leak into each "
            "other under packing.kind=tree and packing.kind=sequence alike. Use a full-attention model (e.g. "
            "Qwen/Qwen3-1.7B)."
        )
    try:
        attn = resolve_attn_implementation(cfg.attn_implementation, torch.device(device))
    except ValueError as e:
        raise UserError(str(e)) from e
    model = AutoModelForCausalLM.from_pretrained(
        path,
        revision=cfg.revision,
        trust_remote_code=cfg.trust_remote_code,
        dtype=torch_dtype(cfg.dtype),
        attn_implementation=attn,
    )
    logger.info("model.attn_implementation=%s: attention runs as %s", cfg.attn_implementation, attn)
    model.config.use_cache = False
    if cfg.lora.enabled:  # only the adapter trains (model/lora.py)
        from asyncgrpo_cli.model.lora import apply_lora

        model = apply_lora(model, cfg.lora)
    if cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device)
