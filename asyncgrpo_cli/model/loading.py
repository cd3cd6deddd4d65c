"""Loading the policy model and tokenizer for training."""

from __future__ import annotations

import logging
from typing import Any

from asyncgrpo_cli.config.schema import ModelConfig
from asyncgrpo_cli.errors import UserError

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}

NO_HUB_KERNELS = {"use_kernels": False}
"""``from_pretrained`` keywords of every model this project loads (the trained policy, the embedded server's).
transformers 5.25 turned ``use_kernels`` on by default: on CUDA it swaps RMSNorm, RoPE and other layers for
kernels fetched from the Hugging Face Hub at load time, which fails offline and changes the numerics the exactness
tests and ``trainer.compile``'s fused layers are measured against. Earlier releases default to ``False``."""


def torch_dtype(name: str) -> Any:
    import torch

    if name == "auto":
        return "auto"
    return getattr(torch, _DTYPES[name])


def linear_attention_layers(config: Any) -> list[int]:
    """Indices of the decoder layers that are linear attention (gated DeltaNet) in a Qwen3.5 / Qwen3-Next style
    config (``layer_types``, on the config or its ``text_config``); empty for other models."""
    for cfg in (config, getattr(config, "text_config", None)):
        layer_types = getattr(cfg, "layer_types", None) if cfg is not None else None
        if layer_types and any("linear" in str(t) for t in layer_types):
            return [i for i, t in enumerate(layer_types) if "linear" in str(t)]
    return []


def attention_head_dim(config: Any) -> int:
    """The attention heads' dim of a decoder config (its ``text_config`` for a multimodal wrapper): ``head_dim``,
    else hidden size / heads."""
    cfg = getattr(config, "text_config", None) or config
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def attention_heads(config: Any) -> tuple[int, int]:
    """(query heads, key / value heads) of a decoder config (its ``text_config`` for a multimodal wrapper)."""
    cfg = getattr(config, "text_config", None) or config
    return cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


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
    see ``model/flex.py``). Gated-DeltaNet layers of hybrid models get the exact packed forward of
    ``model/gdn/layer.py`` with ``model.linear_attention_kernel`` resolved for ``device``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncgrpo_cli.model.flex import (
        FLEX_IMPL,
        describe_options,
        resolve_attn_implementation,
        set_kernel_options,
    )
    from asyncgrpo_cli.model.flex_backend import backend_for
    from asyncgrpo_cli.model.gdn.layer import resolve_kernel

    try:
        config = AutoConfig.from_pretrained(
            path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except OSError as e:
        raise UserError(
            f"model.name_or_path {path!r} cannot be loaded ({e}); give a hub id, a local directory "
            "saved with save_pretrained, or builtin:tiny-qwen3 / builtin:smollm2-135m-instruct."
        ) from e
    linear = linear_attention_layers(config)
    try:
        attn = resolve_attn_implementation(cfg.attn_implementation, torch.device(device))
        kernel = resolve_kernel(cfg.linear_attention_kernel, torch.device(device)) if linear else None
        if attn == FLEX_IMPL:
            dev = torch.device(device)
            heads = (*attention_heads(config), attention_head_dim(config))
            backend = backend_for(cfg.flex_backend, dev, *heads, triton_tiles=bool(cfg.flex_kernel_options))
            set_kernel_options(
                cfg.flex_kernel_options, dev if cfg.flex_tuned_options else None, flash=backend == "flash"
            )
    except ValueError as e:
        raise UserError(str(e)) from e
    model = AutoModelForCausalLM.from_pretrained(
        path,
        revision=cfg.revision,
        trust_remote_code=cfg.trust_remote_code,
        dtype=torch_dtype(cfg.dtype),
        attn_implementation=attn,
        **NO_HUB_KERNELS,
    )
    logger.info("model.attn_implementation=%s: attention runs as %s", cfg.attn_implementation, attn)
    if attn == FLEX_IMPL:
        logger.info(
            "flex attention kernel options (16-bit): %s", describe_options(attention_head_dim(model.config))
        )
    if (cfg.flex_kernel_options or cfg.flex_backend == "flash") and attn != FLEX_IMPL:
        logger.warning(
            "model.flex_kernel_options / model.flex_backend are not used: attention runs as %s, not flex "
            "attention",
            attn,
        )
    model.config.use_cache = False
    if linear:
        _install_packed_linear_attention(model, path, kernel)
    model._asyncgrpo_checkpoint_prefix = checkpoint_prefix(config, model)
    if cfg.lora.enabled:  # only the adapter trains (model/lora.py)
        from asyncgrpo_cli.model.lora import apply_lora

        model = apply_lora(model, cfg.lora)
    if cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device)


def _install_packed_linear_attention(model: Any, path: str, kernel: str) -> None:
    from asyncgrpo_cli.model.gdn.layer import install

    try:
        info = install(model, kernel)
    except (TypeError, ValueError) as e:
        raise UserError(
            f"model.name_or_path {path!r} has linear-attention layers this trainer cannot pack exactly ({e}); "
            "gated-DeltaNet models of the Qwen3.5 / Qwen3-Next families are supported."
        ) from e
    if info is None:
        raise UserError(
            f"model.name_or_path {path!r}: the config declares linear-attention layers but the loaded model has no "
            "gated-DeltaNet module (decoder layers' linear_attn); only Qwen3.5 / Qwen3-Next style layers are supported."
        )
    logger.info(
        "linear attention (gated DeltaNet, %s) in decoder layers %s: packed rows run the %s kernel with "
        "per-sample / per-branch state and path convolutions",
        info.family,
        list(info.layers),
        info.kernel,
    )


def checkpoint_prefix(config: Any, model: Any) -> tuple[str, str] | None:
    """``(trainer prefix, checkpoint prefix)`` where the checkpoint names the text decoder's weights differently
    from the model the trainer loaded, else None.

    The released Qwen3.5 / Qwen3.5-MoE checkpoints are vision-language models (``...ForConditionalGeneration``,
    a ``text_config``, the decoder under ``model.language_model.``); the trainer loads their text decoder
    (``...ForCausalLM``: ``model.layers...``) and a server serving the checkpoint expects its own names in weight
    updates (vLLM: "There is no module or parameter named 'model'"). Weight sync renames with this
    (:func:`checkpoint_name`); checkpoints the trainer saves keep the trainer's (text-only) names.
    """
    archs = getattr(config, "architectures", None) or []
    if getattr(config, "text_config", None) is None or not any(
        "ForConditionalGeneration" in a for a in archs
    ):
        return None
    names = [n for n, _ in model.named_parameters()]
    if any(n.startswith("model.language_model.") for n in names) or not any(
        n.startswith("model.") for n in names
    ):
        return None
    return ("model.", "model.language_model.")


def checkpoint_name(model: Any, name: str) -> str:
    """The served checkpoint's name for the trainer's weight ``name`` (see :func:`checkpoint_prefix`)."""
    prefix = getattr(model, "_asyncgrpo_checkpoint_prefix", None)
    if prefix is None or not name.startswith(prefix[0]):
        return name
    return prefix[1] + name[len(prefix[0]) :]
