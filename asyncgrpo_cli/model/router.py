"""The MoE router's auxiliary load-balancing loss (reference f.6), exact on packed rows.

For a mixture-of-experts model (:func:`is_moe`) with a non-zero coefficient (``loss.router_aux_loss_coef``; None:
the model config's ``router_aux_loss_coef``; 0 disables), each row's aux loss is multiplied by the coefficient and
added to the loss; it is logged raw (before the multiplication) as ``aux_loss``. Settled once, at trainer start,
by :func:`resolve_router_aux` (a :class:`RouterAux`, or None: no term, no metric, no router logits recorded).

Router logits. The trainer never runs the CausalLM forward (``model/logprobs.py`` calls the decoder body, then a
chunked LM head), so it asks the decoder for them: in transformers 5.x (checked on 5.17 and 5.24) the decoder's
``capture_outputs`` hooks record every router's logits (``OutputRecorder(<Model>TopKRouter, index=0)``, one
[T, E] tensor per MoE layer, on the graph) when it is called with ``output_router_logits=True``
(:func:`router_decoder_kwargs`), returned as ``out.router_logits``. Under gradient checkpointing the hooks record
the first forward only (the collector is off during the recompute), and the gradient reaches the router weights.

The loss. ``load_balancing_loss_func`` of the model's own modeling module (the function its CausalLM forward
calls with ``output_router_logits=True``; Switch Transformer eq. 4-6, as transformers implements it):

    f_e = Σ_l Σ_t w_t [e ∈ topk_l(t)] / (L Σ_t w_t)        P_e = Σ_l Σ_t w_t softmax(z_l(t))_e / (L Σ_t w_t)
    aux = E Σ_e f_e P_e

over the L MoE layers, E experts, top-k per token, with per-token weights ``w_t`` (its ``attention_mask``: 0/1 for
a padded batch, any float here). A model whose module has no such function with the standard signature
``(gate_logits, num_experts, top_k, attention_mask)``, or whose decoder records no router logits, gets no aux loss:
an error when the coefficient was set, a warning when it came from the model config.

Exact on packed rows. A row forwards several samples; the tree packer forwards a prefix shared by k samples once.
In a padded batch of the same samples that token would appear k times, with identical router logits (same
path, same positions). So the row calls the function with ``w_t = row.multiplicity[t]``, the number of the row's
samples whose path contains position t (1 everywhere under sequence packing): every Σ_t above then equals the
padded batch's, and the row's aux loss equals transformers' value for its samples forwarded unpacked
(``tests/test_router_aux_loss.py``).

Step normalization (``train/step.py``). A rank's row r contributes ``loss_r * W`` for the policy loss (W = world
size; FSDP2 averages gradients over ranks) plus ``coef * aux_r / R``, R = the rows of this rank in the step (one
per micro-batch; every rank gets the same number, filler rows included). The optimizer sees
``(1/W) Σ_ranks Σ_r ∇(coef aux_r / R) = coef ∇ (1/(W R)) Σ_rows aux_r``: the coefficient times the mean aux loss
over all the step's rows (every micro-batch, every rank), independent of W and of the accumulation steps. The
logged ``loss`` includes the term; ``aux_loss`` is the raw mean over the step's rows.

MoE detection covers configs with ``num_experts`` (Qwen2-MoE, Qwen3-MoE, Qwen3.5-MoE and Qwen3-Next text configs,
OLMoE, ...), ``num_local_experts`` (Mixtral, GPT-OSS, MiniMax, PhiMoE, ...) or ``n_routed_experts`` (DeepSeek
V2/V3, GLM-4.5 MoE, dots1, ...) > 0, with ``num_experts_per_tok`` > 0; a composite config is read through its
``text_config``. Transformers' DeepSeek-V3-style models (sigmoid routing, bias balancing) compute no aux loss, so
for them a coefficient is refused (and one from their config is ignored with a warning). Not detected: DBRX
(experts and top-k in ``ffn_config``) and the encoder-decoder Switch / NLLB-MoE (not causal LMs).
"""

from __future__ import annotations

import inspect
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from asyncgrpo_cli.errors import UserError

if TYPE_CHECKING:
    from asyncgrpo_cli.packing.row import PackedRow

logger = logging.getLogger(__name__)

KEY = "loss.router_aux_loss_coef"
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_LOSS_PARAMS = ["gate_logits", "num_experts", "top_k", "attention_mask"]


@dataclass(frozen=True)
class RouterAux:
    """How the rows of a run compute their router aux loss (built by :func:`resolve_router_aux`)."""

    coef: float
    """Multiplies each row's aux loss in the training loss (non-zero)."""
    num_experts: int
    top_k: int
    loss_func: Callable[..., torch.Tensor]
    """transformers' ``load_balancing_loss_func`` of the model's modeling module."""


def _positive_int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _moe_config(config: Any) -> Any | None:
    """The config (the model's or its ``text_config``) that declares routed experts with a per-token top-k."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        experts = max((_positive_int(getattr(cfg, key, None)) for key in _EXPERT_KEYS), default=0)
        if experts and _positive_int(getattr(cfg, "num_experts_per_tok", None)):
            return cfg
    return None


def is_moe(config: Any) -> bool:
    """Whether ``config`` (a transformers model config) is a mixture-of-experts model with top-k routing."""
    return _moe_config(config) is not None


def moe_shape(config: Any) -> tuple[int, int]:
    """(experts, top-k) of an MoE config; ValueError for a dense one."""
    cfg = _moe_config(config)
    if cfg is None:
        raise ValueError(f"{type(config).__name__} is not a mixture-of-experts config")
    experts = next(n for key in _EXPERT_KEYS if (n := _positive_int(getattr(cfg, key, None))))
    return experts, int(cfg.num_experts_per_tok)


def _config_coef(config: Any) -> float | None:
    for cfg in (_moe_config(config), config):
        value = getattr(cfg, "router_aux_loss_coef", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _loss_func(decoder: Any) -> tuple[Callable[..., torch.Tensor] | None, str]:
    """transformers' load-balancing loss for ``decoder``'s model family, or (None, why not)."""
    cls = type(decoder)
    recordable = getattr(cls, "_can_record_outputs", None) or {}
    if "router_logits" not in recordable:
        return None, f"its decoder ({cls.__name__}) does not record router logits"
    func = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
    if func is None:
        return None, f"{cls.__module__} has no load_balancing_loss_func (its CausalLM computes no aux loss)"
    params = list(inspect.signature(func).parameters)
    if params[: len(_LOSS_PARAMS)] != _LOSS_PARAMS:
        return None, f"{cls.__module__}.load_balancing_loss_func takes ({', '.join(params)})"
    return func, ""


def resolve_router_aux(model: Any, coef: float | None) -> RouterAux | None:
    """The run's router aux loss: None when off (dense model with ``coef`` unset, coefficient 0, or an MoE model
    transformers computes no aux loss for, with the coefficient from its config); UserError naming
    ``loss.router_aux_loss_coef`` for a coefficient set on a dense model or on an unsupported MoE model."""
    config = model.config
    name = getattr(config, "_name_or_path", "") or getattr(config, "model_type", "?")
    model_type = getattr(config, "model_type", "?")
    if not is_moe(config):
        if coef is not None:
            raise UserError(
                f"{KEY}={coef} is set, but model.name_or_path {name!r} ({model_type}) is not a mixture-of-experts "
                "model (its config has no num_experts / num_local_experts / n_routed_experts with "
                f"num_experts_per_tok): remove {KEY} (leave it null) for dense models."
            )
        return None
    value, source = (coef, KEY) if coef is not None else (_config_coef(config), "the model config")
    if value is None or value == 0.0:
        logger.info("MoE model %s: no router aux loss (coefficient %s from %s)", name, value, source)
        return None
    if not math.isfinite(value) or value < 0:
        raise UserError(f"{KEY}: the coefficient from {source} is {value}; it must be a finite number >= 0.")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    func, why = _loss_func(decoder) if decoder is not None else (None, "it has no decoder body")
    if func is None:
        if coef is not None:
            raise UserError(
                f"{KEY}={coef}: transformers has no router load-balancing loss for {model_type} ({why}); "
                f"set {KEY}=0 or leave it null."
            )
        logger.warning(
            "MoE model %s: its config sets router_aux_loss_coef=%s, but transformers has no router "
            "load-balancing loss for %s (%s): training without it",
            name,
            value,
            model_type,
            why,
        )
        return None
    experts, top_k = moe_shape(config)
    logger.info(
        "MoE model %s (%d experts, top %d): router aux loss x %s (from %s), logged as aux_loss",
        name,
        experts,
        top_k,
        value,
        source,
    )
    return RouterAux(coef=float(value), num_experts=experts, top_k=top_k, loss_func=func)


def router_decoder_kwargs(router: RouterAux | None) -> dict[str, Any]:
    """Extra keyword arguments of the decoder call: record the router logits when the row needs its aux loss."""
    return {"output_router_logits": True} if router is not None else {}


def row_aux_loss(router: RouterAux | None, out: Any, row: PackedRow) -> torch.Tensor | None:
    """The row's aux loss (fp32 0-d, differentiable) from the decoder output ``out``; None without ``router``.

    Each forwarded token is weighted by ``row.multiplicity`` (module docstring), so the value equals
    transformers' for the row's samples forwarded as a padded batch.
    """
    if router is None:
        return None
    logits = getattr(out, "router_logits", None)
    if not logits:
        raise RuntimeError(
            "the decoder returned no router logits with output_router_logits=True: this transformers version "
            f"does not record them for {type(out).__name__}; set {KEY}=0"
        )
    weights = row.multiplicity
    if weights is None:
        if row.num_unpacked != row.num_forwarded:
            raise ValueError(
                "a packed row that shares tokens between samples must carry PackedRow.multiplicity for the "
                "router aux loss"
            )
    else:
        weights = weights.to(dtype=torch.float32)[None]
    aux = router.loss_func(tuple(logits), router.num_experts, router.top_k, weights)
    return aux.float()
