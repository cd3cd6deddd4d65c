"""Flex attention for packed rows: transformers' attention interface -> compiled ``flex_attention`` + a BlockMask.

``model.attn_implementation`` (:data:`ATTN_CHOICES`):
  - ``auto`` (default): ``flex_attention`` on CUDA, ``sdpa`` elsewhere;
  - ``sdpa`` / ``eager``: the row's intervals rendered as a dense [T, T] mask (``packing/attention.py``);
  - ``flex_attention``: the loader registers :func:`flex_attention_forward` with transformers under
    :data:`FLEX_IMPL` and loads the model with it, so a stock Qwen3 / Llama runs it unchanged. The log-prob head
    builds one block-sparse ``BlockMask`` per row from the intervals (never a T² mask) and passes it as
    ``attention_mask``; transformers hands a 4D mask to every layer as-is. CUDA only: flex attention has no CPU
    backward (docs/platform-notes.md).

Compilation: ``flex_attention`` is compiled once per process (:func:`compiled_flex_attention`) with static
shapes. Compiled flex can specialize on the row length even when asked for dynamic shapes (``flex_attention``
compares q/k lengths with the BlockMask's Python-int lengths, which guards them; pytorch#189952), and dynamic
flex kernels are the less-trodden path (on CPU, torch 2.13 fails to build one), so rows are padded to a
power-of-two bucket (``packing.attention.flex_length``): a run compiles a handful of shapes instead
of recompiling for every new row length until dynamo's recompile limit sends it to the eager fallback, which
materializes the full score matrix. The padding costs a copy of q/k/v per layer: padded blocks are in no block
list, so the kernel skips them.

Kernel options (``model.flex_kernel_options``): torch's ``FlexKernelOptions`` (block sizes, stages, warps, TMA;
``fwd_`` / ``bwd_`` prefixes reach one pass), set once per process by the loader (:func:`set_kernel_options`,
checked against torch's names) and passed to every ``flex_attention`` call, compiled layers included. Empty
(the default): the tiles this project measured fastest for the GPU and head size (:data:`TUNED_OPTIONS`, with
``model.flex_tuned_options=true``, 16-bit q / k / v only), else torch's own table for the GPU. ``asyncgrpo bench
attention`` measures candidates on packed rows' masks; ``bench trainer flex_options=`` whole steps with them.

Kernels (``model.flex_backend``): Triton templates, or FlashAttention-4's where it runs (``model/flex_backend.py``).

This module imports neither torch nor transformers at import time (``asyncgrpo check`` validates the choice).
"""

from __future__ import annotations

import functools
from typing import Any

from asyncgrpo_cli.config.schema import ATTN_CHOICES
from asyncgrpo_cli.model.flex_backend import FLASH_OPTIONS

FLEX_IMPL = "asyncgrpo_flex"
"""The transformers ``attn_implementation`` key :func:`flex_attention_forward` is registered under."""
FLEX_IMPLS = (FLEX_IMPL, "flex_attention")
"""Keys whose attention takes a ``BlockMask`` (transformers' own flex forward too; it gets unpadded masks)."""


TUNED_OPTIONS: dict[tuple[int, int], dict[int, dict[str, Any]]] = {
    (9, 0): {128: {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4}},
}
"""CUDA capability -> head dim -> kernel options measured faster than torch's table on packed tree rows (bf16).
sm90, head dim 128: Inductor's max-autotune picked these forward tiles at 16k and 64k tokens (torch's: 128x64,
8 warps); ``bench attention`` on an H200 timed the forward 3.5% (16k) and 8% (64k) faster with the same output
to the bit (the key tile, which sets the reduction order, is 64 in both). Whole ``bench trainer`` steps gain
within run-to-run noise (the forward is ~9% of a 0.6B step). The backward keeps torch's tiles, which every
candidate lost to (docs/benchmarks.md, 2026-12-03)."""

_KERNEL_OPTIONS: dict[str, Any] = {}
"""``model.flex_kernel_options`` of this process's policy (:func:`set_kernel_options`)."""
_TUNED_GPU: list[tuple[int, int]] = []
"""The capability of this process's GPU when its :data:`TUNED_OPTIONS` apply (:func:`set_kernel_options`)."""
_FLASH: list[bool] = []
"""Non-empty when this process's flex calls of 16-bit heads run FlashAttention-4 (:func:`set_kernel_options`)."""


def tuned_options(capability: tuple[int, int] | None, head_dim: int, dtype: Any) -> dict[str, Any]:
    """The measured options for a GPU of ``capability`` and heads of ``head_dim`` in ``dtype`` (16-bit only), or
    {} (torch's table)."""
    import torch

    if dtype not in (torch.bfloat16, torch.float16) or not capability:
        return {}
    return dict(TUNED_OPTIONS.get(tuple(capability), {}).get(head_dim, {}))


def set_kernel_options(options: dict[str, Any], tuned_for: Any = None, flash: bool = False) -> None:
    """Pass ``options`` to every later flex attention call of this process (the policy's loader sets them); with
    ``options`` empty and ``tuned_for`` a CUDA device, calls of 16-bit heads get that GPU's :data:`TUNED_OPTIONS`;
    with ``flash``, calls of 16-bit heads run FlashAttention-4 (:data:`FLASH_OPTIONS`) instead.

    Raises ValueError naming ``model.flex_kernel_options`` for a name torch's ``FlexKernelOptions`` lacks
    (with or without its ``fwd_`` / ``bwd_`` prefix).
    """
    import torch
    from torch.nn.attention.flex_attention import FlexKernelOptions

    known = FlexKernelOptions.__optional_keys__ | FlexKernelOptions.__required_keys__
    unknown = [k for k in options if k.removeprefix("fwd_").removeprefix("bwd_") not in known]
    if unknown:
        raise ValueError(
            f"model.flex_kernel_options: {', '.join(unknown)} not among this torch's flex attention kernel "
            f"options ({', '.join(sorted(known))}, optionally prefixed fwd_ / bwd_)"
        )
    _KERNEL_OPTIONS.clear()
    _KERNEL_OPTIONS.update(options)
    _TUNED_GPU.clear()
    if not options and tuned_for is not None and torch.device(tuned_for).type == "cuda":
        _TUNED_GPU.append(tuple(torch.cuda.get_device_capability(tuned_for)))
    _FLASH.clear()
    if flash:
        _FLASH.append(True)


def active_backend() -> str:
    """``flash`` or ``triton``: the kernels this process's flex calls of 16-bit heads run
    (:func:`set_kernel_options`)."""
    return "flash" if _FLASH else "triton"


def call_options(query: Any) -> dict[str, Any] | None:
    """The ``kernel_options`` of a flex call on ``query`` [B, H, L, D] (``None``: torch's table)."""
    import torch

    if _FLASH and query.dtype in (torch.bfloat16, torch.float16):
        return dict(FLASH_OPTIONS)
    if _KERNEL_OPTIONS:
        return dict(_KERNEL_OPTIONS)
    gpu = _TUNED_GPU[0] if _TUNED_GPU else None
    return tuned_options(gpu, query.shape[-1], query.dtype) or None


def describe_options(head_dim: int) -> str:
    """Which kernel options flex calls of 16-bit heads of ``head_dim`` get (for the loader's log)."""
    import torch

    if _FLASH:
        return (
            "FlashAttention-4 (model.flex_backend; fp32 heads: Triton; its backward is not bit-reproducible: "
            "model.flex_backend=triton for that)"
        )
    if _KERNEL_OPTIONS:
        return f"model.flex_kernel_options {_KERNEL_OPTIONS}"
    tuned = tuned_options(_TUNED_GPU[0] if _TUNED_GPU else None, head_dim, torch.bfloat16)
    if tuned:
        return f"tuned for this GPU and head dim {head_dim} {tuned} (model.flex_tuned_options)"
    return "torch's table for the GPU"


def resolve_attn_implementation(name: str, device: Any) -> str:
    """The transformers ``attn_implementation`` for ``model.attn_implementation=name`` on ``device``.

    Raises ValueError naming the key and the fix for an unknown value or flex attention off CUDA.
    """
    if name not in ATTN_CHOICES:
        raise ValueError(
            f"model.attn_implementation={name!r} is not supported: use one of {', '.join(ATTN_CHOICES)} "
            "(transformers' flash_attention kernels would ignore a packed row's attention mask; FlashAttention-4 "
            "runs under flex attention: model.flex_backend)"
        )
    if name == "auto":
        name = "flex_attention" if device.type == "cuda" else "sdpa"
    if name != "flex_attention":
        return name
    if device.type != "cuda":
        raise ValueError(
            f"model.attn_implementation=flex_attention needs a CUDA device (the trainer runs on {device}): flex "
            "attention has no backward on CPU; use model.attn_implementation=auto or sdpa"
        )
    register_flex()
    return FLEX_IMPL


@functools.cache
def register_flex() -> None:
    """Register :func:`flex_attention_forward` with transformers under :data:`FLEX_IMPL`. Idempotent.

    No mask builder is registered: transformers then passes ``attention_mask=None`` to a call without a 4D mask
    (e.g. a plain ``model(input_ids)`` probe), which :func:`flex_attention_forward` treats as one causal sequence.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX_IMPL, flex_attention_forward)


@functools.cache
def compiled_flex_attention() -> Any:
    """``torch.compile(flex_attention)`` with static shapes, created once per process (see the module doc)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def row_block_mask(leave: Any, impl: str) -> Any:
    """The ``BlockMask`` of a row's intervals ``leave`` (int64 [T]) for attention implementation ``impl``.

    For :data:`FLEX_IMPL` on CUDA it is built at the padded length ``flex_length(T)``; elsewhere at T (the
    uncompiled CPU forward and transformers' own flex forward take the row as is).
    """
    from asyncgrpo_cli.packing.attention import flex_block_mask, flex_length

    n = int(leave.shape[0])
    return flex_block_mask(leave, flex_length(n) if impl == FLEX_IMPL and leave.is_cuda else n)


def _causal_block_mask(query: Any, key: Any) -> Any:
    """The BlockMask of a plain causal forward (one sequence, no cache), for a call that passed no mask."""
    import torch

    batch, n = query.shape[0], query.shape[-2]
    if batch != 1 or key.shape[-2] != n:
        raise ValueError(
            f"the {FLEX_IMPL} attention got no BlockMask for a batch of {batch} x {n} queries / "
            f"{key.shape[-2]} keys: only a single sequence without cache runs without one (a padding mask would be "
            "lost); pass a BlockMask (model/logprobs.py) or load the model with model.attn_implementation=sdpa"
        )
    return row_block_mask(torch.full((n,), n, dtype=torch.int64, device=query.device), FLEX_IMPL)


def _pad_to(x: Any, length: int) -> Any:
    """[B, H, L, D] -> [B, H, length, D], zero padded, contiguous (one memory layout per compiled shape)."""
    import torch.nn.functional as F

    if x.shape[-2] != length:
        x = F.pad(x, (0, 0, 0, length - x.shape[-2]))
    return x.contiguous()


def flex_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers attention function: q [B, Hq, L, D], k / v [B, Hkv, S, D] -> ([B, L, Hq, D], None).

    ``attention_mask`` is a ``BlockMask`` (see :func:`row_block_mask`), or None for one plain causal sequence;
    q / k / v are zero-padded to the mask's lengths and the output cropped back. Compiled on CUDA, eager on CPU
    (forward only: tests). A sliding window is not applied (the log-prob head refuses rows whose samples exceed
    it); soft-capping, attention sinks and dropout are refused rather than silently dropped.
    """
    import torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if attention_mask is None:
        attention_mask = _causal_block_mask(query, key)
    if not isinstance(attention_mask, BlockMask):
        raise TypeError(
            f"the {FLEX_IMPL} attention needs a flex BlockMask as attention_mask, got "
            f"{type(attention_mask).__name__}: run the model through model/logprobs.token_logprobs (it builds one "
            "per row), or load it with model.attn_implementation=sdpa"
        )
    if dropout > 0:
        raise ValueError(
            f"attention dropout ({dropout}) is not supported by {FLEX_IMPL}: set it to 0 in the config"
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{FLEX_IMPL} does not implement attention {name}: use sdpa for this model"
            )
    q_len, kv_len = attention_mask.seq_lengths
    n = query.shape[-2]
    query = _pad_to(query, q_len)
    key, value = _pad_to(key, kv_len), _pad_to(value, kv_len)
    if torch.compiler.is_compiling():
        attend = flex_attention  # inside a compiled layer (trainer.compile): compiled with it
    else:
        attend = compiled_flex_attention() if query.is_cuda else flex_attention
    out = attend(
        query,
        key,
        value,
        block_mask=attention_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        kernel_options=call_options(query),
    )
    return out[:, :, :n].transpose(1, 2).contiguous(), None
