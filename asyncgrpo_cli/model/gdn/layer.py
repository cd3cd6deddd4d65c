"""Exact packed training for gated-DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the layers' packed forward.

transformers' gated-DeltaNet forward runs its short convolution and its recurrence over the whole row, so packed
samples would leak into each other (neither a 4D mask nor position resets reach those layers). :func:`install`
gives every linear-attention module of a loaded model a forward that, when the log-prob head passes a
:class:`~asyncgrpo_cli.model.gdn.plan.RecurrencePlan` (keyword :data:`PLAN_KWARG`, built once per row from its DFS
intervals), runs

    projections (the family's own modules)  ->  path conv (``gdn/conv.py``)  ->  delta rule per segment tree
    (``gdn/rule_torch.py`` on CPU, fla's Triton chunk kernels on CUDA: ``gdn/rule_fla.py``)  ->  gated norm, out_proj

with the module's own parameters (so FSDP2, LoRA on its linears and checkpoints see the stock module). Without a
plan the stock forward runs (generation, probes). Layers are found by structure, not class name: a decoder layer's
``linear_attn`` with ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` (Qwen3.5 family) or
``in_proj_qkvz`` / ``in_proj_ba`` + ``fix_query_key_value_ordering`` (Qwen3-Next), and ``conv1d``, ``A_log``,
``dt_bias``, ``norm``, ``out_proj``; anything else is refused with the model's name.

Why by hand: transformers has no packed path for these layers (its fallback ignores ``cu_seq_lens``; fla's kernels
take ``cu_seqlens`` for sequence packing but know no trees), and TRL's tree version is not a library.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncgrpo_cli.model.gdn import PLAN_KWARG  # transformers passes extra decoder keywords to the layers
from asyncgrpo_cli.model.gdn.conv import path_conv
from asyncgrpo_cli.model.gdn.plan import RecurrencePlan

logger = logging.getLogger(__name__)

KERNELS = ("auto", "torch", "fla")

_QWEN3_5 = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_QWEN3_NEXT = ("in_proj_qkvz", "in_proj_ba")
_COMMON = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")


@dataclass(frozen=True)
class LinearAttentionInfo:
    """What ``asyncgrpo check`` and the trainer report: which decoder layers are linear attention, the family."""

    layers: tuple[int, ...]
    family: str
    kernel: str


def layer_family(module: nn.Module) -> str:
    """``qwen3_5`` or ``qwen3_next`` for a gated-DeltaNet module; TypeError for a layout this code does not know."""
    if not all(hasattr(module, name) for name in _COMMON):
        missing = [name for name in _COMMON if not hasattr(module, name)]
        raise TypeError(
            f"{type(module).__name__} is not a gated-DeltaNet layer this trainer knows (no {missing})"
        )
    if all(hasattr(module, name) for name in _QWEN3_5):
        return "qwen3_5"
    if all(hasattr(module, name) for name in _QWEN3_NEXT) and hasattr(module, "fix_query_key_value_ordering"):
        return "qwen3_next"
    raise TypeError(
        f"{type(module).__name__}: unknown gated-DeltaNet projection layout (expected {_QWEN3_5} or {_QWEN3_NEXT})"
    )


def linear_attention_modules(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, its ``linear_attn``) for every linear-attention layer of ``model``."""
    found = []
    for i, layer in enumerate(_layers(model)):
        mixer = getattr(layer, "linear_attn", None)
        if mixer is not None:
            found.append((i, mixer))
    return found


def _layers(model: nn.Module) -> Any:
    for name in ("model.layers", "model.language_model.layers", "base_model.model.model.layers", "layers"):
        obj: Any = model
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    return []


def resolve_kernel(name: str, device: torch.device) -> str:
    """``model.linear_attention_kernel`` -> the kernel that runs: ``fla`` (CUDA, fla usable) or ``torch``."""
    if name not in KERNELS:
        raise ValueError(f"model.linear_attention_kernel={name!r}: use one of {', '.join(KERNELS)}")
    if name == "torch":
        return "torch"
    why = (
        "the trainer runs on CPU (fla's kernels are Triton, CUDA only)"
        if device.type != "cuda"
        else fla_status()
    )
    if name == "fla" and why:
        raise ValueError(f"model.linear_attention_kernel=fla cannot run: {why}; use auto or torch")
    if name == "auto" and device.type == "cuda" and why:
        logger.warning(
            "gated-DeltaNet layers run the pure-torch chunked kernel on CUDA (exact, slower): %s", why
        )
    return "torch" if why else "fla"


@functools.cache
def fla_status() -> str | None:
    """None when fla's gated-delta-rule kernels can train in this environment, else why not (with the fix).

    fla itself refuses the gated backward on Hopper with Triton >= 3.4 and < 3.7.1 (wrong results there,
    fla-org/flash-linear-attention#640) unless TileLang is installed; that is checked here, before a run starts,
    rather than at the first backward.
    """
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        from fla import utils as fla_utils
    except ImportError as e:
        return f"fla is not installed ({e}): pip install 'asyncgrpo[gpu]' (fla-core)"
    except Exception as e:  # noqa: BLE001 - a Triton without a GPU backend, a broken install
        return f"fla cannot be imported ({type(e).__name__}: {e})"
    hopper = bool(getattr(fla_utils, "IS_NVIDIA_HOPPER", False))
    affected = bool(getattr(fla_utils, "TRITON_ABOVE_3_4_0", False)) and not getattr(
        fla_utils, "TRITON_ABOVE_3_7_1", True
    )
    if hopper and affected and importlib.util.find_spec("tilelang") is None:
        import triton

        return (
            f"fla refuses its gated backward on Hopper GPUs with Triton {triton.__version__} (>= 3.4, < 3.7.1: "
            "wrong results, fla-org/flash-linear-attention#640): upgrade Triton to >= 3.7.1 or pip install tilelang"
        )
    return None


def fla_available() -> bool:
    """fla's kernels can train here (see :func:`fla_status`)."""
    return fla_status() is None


def _rule(kernel: str) -> Callable[..., torch.Tensor]:
    if kernel == "fla":
        from asyncgrpo_cli.model.gdn.rule_fla import fla_tree_gated_delta_rule

        return fla_tree_gated_delta_rule
    from asyncgrpo_cli.model.gdn.rule_torch import tree_chunk_gated_delta_rule

    return tree_chunk_gated_delta_rule


def install(model: nn.Module, kernel: str) -> LinearAttentionInfo | None:
    """Give every linear-attention layer of ``model`` the packed forward (``kernel``: ``torch`` or ``fla``).

    Returns None for a model without such layers. Idempotent (a second call switches the kernel).
    """
    modules = linear_attention_modules(model)
    if not modules:
        return None
    families = {layer_family(m) for _, m in modules}
    if kernel not in ("torch", "fla"):
        raise ValueError(f"install(kernel={kernel!r}): a resolved kernel, torch or fla (see resolve_kernel)")
    for _, module in modules:
        stock = getattr(type(module), "_asyncgrpo_stock_class", type(module))
        module.__class__ = _packed_class(stock)
        module._asyncgrpo_kernel = kernel
    model._asyncgrpo_gdn_taps = conv_taps(model)
    model._asyncgrpo_gdn_kernel = kernel
    return LinearAttentionInfo(tuple(i for i, _ in modules), "+".join(sorted(families)), kernel)


def installed_kernel(model: nn.Module) -> str | None:
    """The kernel :func:`install` gave ``model``'s linear-attention layers (``fla`` / ``torch``); None if none."""
    return getattr(model, "_asyncgrpo_gdn_kernel", None)


def conv_taps(model: nn.Module) -> int:
    """The short convolution's kernel size of ``model``'s linear-attention layers (one value for all)."""
    sizes = {int(m.conv1d.weight.shape[-1]) for _, m in linear_attention_modules(model)}
    if len(sizes) != 1:
        raise ValueError(f"linear-attention layers with different conv kernel sizes: {sorted(sizes)}")
    return sizes.pop()


@functools.cache
def _packed_class(cls: type) -> type:
    """``cls`` with a forward that takes a row's plan (:data:`PLAN_KWARG`); without one, ``cls``'s own forward.

    One subclass per layer class, swapped in as FSDP2 swaps classes: every layer of a model shares one forward,
    so a compiled decoder layer (``trainer.compile``) does not guard on a per-layer function and identical layers
    keep sharing one graph.
    """

    def forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plan = kwargs.pop(PLAN_KWARG, None)
        if plan is None:
            return cls.forward(self, hidden_states, *args, **kwargs)
        for name in ("cache", "cache_params", "past_key_values"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    "a packed row's recurrence plan is a training path: run the decoder with use_cache=False"
                )
        return _packed_eager(self, hidden_states, plan, _rule(self._asyncgrpo_kernel))

    return type(f"Packed{cls.__name__}", (cls,), {"forward": forward, "_asyncgrpo_stock_class": cls})


def _projections(
    module: Any, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mixed_qkv [T, conv_dim] before the conv, z [T, Hv, Dv], b [T, Hv], a [T, Hv]) for ``h`` [1, T, H]."""
    n = h.shape[1]
    if hasattr(module, "in_proj_qkv"):
        mixed = module.in_proj_qkv(h)[0]
        z = module.in_proj_z(h)[0].reshape(n, -1, module.head_v_dim)
        return mixed, z, module.in_proj_b(h)[0], module.in_proj_a(h)[0]
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(h), module.in_proj_ba(h))
    mixed = torch.cat([x.reshape(1, n, -1) for x in (q, k, v)], dim=-1)[0]
    return mixed, z[0], b[0], a[0]


def packed_forward(
    module: Any, hidden_states: torch.Tensor, plan: RecurrencePlan, rule: Callable[..., Any]
) -> torch.Tensor:
    """The layer's output [1, T, hidden] for a packed row ``hidden_states`` [1, T, hidden] under ``plan``."""
    if hidden_states.shape[0] != 1 or hidden_states.shape[1] != plan.num_tokens:
        raise ValueError(
            f"a packed row is one sequence of {plan.num_tokens} tokens; the layer got {tuple(hidden_states.shape)}"
        )
    n = plan.num_tokens
    mixed, z, b, a = _projections(module, hidden_states)
    mixed = path_conv(mixed, module.conv1d.weight.squeeze(1), module.conv1d.bias, module.activation, plan)
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(n, -1, module.head_k_dim)
    key = key.reshape(n, -1, module.head_k_dim)
    value = value.reshape(n, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    out = rule(query, key, value, g, beta, plan)
    out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(1, n, -1))


_packed_eager = torch.compiler.disable(packed_forward)
"""The packed forward outside compiled graphs: its scan loops over the row's levels (a new depth would
recompile); the rest of a compiled decoder layer stays compiled."""
