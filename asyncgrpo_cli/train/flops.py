"""Model FLOPs of a training step and the peak they are measured against (``perf/mfu_*``).

Per optimizer step (forward + backward = 3x the forward's matmul FLOPs):

    FLOPs = 6 N · forwarded tokens  +  6 V H · trained tokens  +  12 A · attended (query, key) pairs
            + G · forwarded tokens

- **N**: the *active* parameters of the decoder body (without the embedding / LM-head matrix). Dense models:
  every parameter. Mixture-of-experts: the routed experts count ``num_experts_per_tok / num_experts`` of their
  parameters (a token runs k of the E experts); shared experts, routers and everything else count in full.
  Expert banks are found by structure, not by class: a submodule named ``experts`` (the name transformers'
  MoE blocks give the routed bank: Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral, ...) whose parameters are
  stacked over the experts (leading dim = ``num_experts``: the fused ``gate_up_proj`` [E, 2I, H] /
  ``down_proj`` [E, H, I] of transformers 5.x) or which is a list of ``num_experts`` expert modules (older
  layouts). ``shared_expert`` / ``shared_expert_gate`` / ``gate`` (the router) are other names, so they count
  in full. A config that declares experts without such a bank counts every parameter (and logs a warning).
- **V H**: the LM-head matrix; the chunked head projects only trained positions.
- **A** = softmax-attention layers x heads x head_dim: only the *full-attention* layers. Hybrids list their
  layers in ``layer_types`` (on the config or its ``text_config``); linear-attention entries (gated DeltaNet)
  are not softmax attention. A packed row's attended pairs are Σ_k (leave[k] - k) over its DFS intervals, so
  tree packing's shared prefixes count once (12 = QKᵀ and AV, 2 FLOPs per multiply-add, x3 for the backward).
- **G**: the gated-DeltaNet layers' chunked recurrence per forwarded token (their projections and short
  convolution are parameters, already in 6N). From the chunked algorithm (``model/gdn/rule_torch.py``, the WY
  form transformers and fla use) with chunk C = 64, per value head (query / key heads are repeated to the
  ``Hv`` value heads) with key dim Dk, value dim Dv and state S [Dk, Dv], per chunk of C tokens, forward:

      q·kᵀ and k_beta·kᵀ (intra-chunk scores)        2 · 2 C² Dk
      two unit-triangular solves (u and w)           C² Dv + C² Dk
      intra-chunk scores · v_new                     2 C² Dv
      state reads (w·S, q·S) and write (kᵀ·v_new)    3 · 2 C Dk Dv

  i.e. C² (5 Dk + 3 Dv) + 6 C Dk Dv per chunk, and per token

      G = 3 · Σ_linear layers Hv · (C (5 Dk + 3 Dv) + 6 Dk Dv)        (x3: forward + backward)

  Element-wise work (gates, decays, l2norm) is not counted, nor the chunk padding of short segments (a
  segment is padded to whole chunks; model FLOPs count the real tokens only).

Recomputation (gradient checkpointing, the head's backward) is not counted, as MFU conventionally does not.
MFU = FLOPs / seconds / ranks / peak; logged only when the peak of the device at the compute dtype is known
(bf16 dense on the GPUs in ``PEAK_BF16_TFLOPS``).
"""

from __future__ import annotations

import logging
from typing import Any

from asyncgrpo_cli.model.loading import attention_head_dim, linear_attention_layers

logger = logging.getLogger(__name__)

PEAK_BF16_TFLOPS = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "B200": 2250.0,
}
"""Dense bf16 peak TFLOP/s by GPU name (SXM parts)."""

GDN_CHUNK = 64
"""Chunk length of the chunked gated delta rule (``model/gdn/plan.py``'s CHUNK, fla's and transformers')."""

_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def peak_tflops(device: Any, compute_dtype: str) -> float | None:
    """The dense peak of ``device`` at ``compute_dtype``; None when unknown (CPU, fp32, an unlisted GPU)."""
    if getattr(device, "type", "cpu") != "cuda" or compute_dtype != "bfloat16":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


def text_config(config: Any) -> Any:
    """The decoder's config: ``text_config`` of a multimodal wrapper, else ``config`` itself."""
    return getattr(config, "text_config", None) or config


def attention_width(config: Any) -> int:
    """A = full-attention layers x heads x head_dim (linear-attention layers excluded)."""
    cfg = text_config(config)
    full = cfg.num_hidden_layers - len(linear_attention_layers(config))
    return full * cfg.num_attention_heads * attention_head_dim(config)


def gdn_flops_per_token(config: Any, chunk: int = GDN_CHUNK) -> int:
    """G: forward + backward FLOPs of the gated-DeltaNet recurrences per forwarded token (module docstring)."""
    layers = len(linear_attention_layers(config))
    if not layers:
        return 0
    cfg = text_config(config)
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return 3 * layers * hv * (chunk * (5 * dk + 3 * dv) + 6 * dk * dv)


def moe_experts(config: Any) -> tuple[int, int] | None:
    """(num_experts, num_experts_per_tok) of a mixture-of-experts config; None for a dense one."""
    cfg = text_config(config)
    total = next((getattr(cfg, k) for k in _NUM_EXPERTS_KEYS if getattr(cfg, k, None)), None)
    active = getattr(cfg, "num_experts_per_tok", None)
    if not total or not active:
        return None
    return int(total), int(active)


def routed_expert_params(model: Any, num_experts: int) -> int:
    """Parameters of the routed expert banks of ``model`` (see the module docstring for how they are found)."""
    from torch import nn

    total = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        params = list(module.parameters())
        stacked = isinstance(module, nn.ModuleList) and len(module) == num_experts
        fused = bool(params) and all(p.dim() >= 2 and p.shape[0] == num_experts for p in params)
        if stacked or fused:
            total += sum(p.numel() for p in params)
    return total


class StepFlops:
    """FLOPs of a step from its token counts, for one model (the module docstring's formula)."""

    def __init__(self, model: Any):
        cfg = text_config(model.config)
        self.attn_width = attention_width(model.config)
        self.linear = gdn_flops_per_token(model.config)
        self.head = cfg.vocab_size * cfg.hidden_size
        matrices = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m}
        self.total_body = sum(p.numel() for p in model.parameters() if id(p) not in matrices)
        self.experts, self.body = 0, self.total_body
        moe = moe_experts(model.config)
        if moe is not None:
            num, per_tok = moe
            self.experts = routed_expert_params(model, num)
            if self.experts == 0:
                logger.warning(
                    "the config declares %d experts but no expert bank (a module named 'experts' with "
                    "parameters stacked over them) was found: MFU counts every parameter as active",
                    num,
                )
            self.body = self.total_body - self.experts + self.experts * per_tok // num

    def terms(self, forwarded: int, trained: int, attn_pairs: int) -> dict[str, float]:
        """The formula's terms: dense (6 N T), head, attention (12 A pairs), linear (G T), and their total."""
        out = {
            "dense": 6.0 * self.body * forwarded,
            "head": 6.0 * self.head * trained,
            "attention": 12.0 * self.attn_width * attn_pairs,
            "linear": float(self.linear) * forwarded,
        }
        out["total"] = sum(out.values())
        return out

    def __call__(self, forwarded: int, trained: int, attn_pairs: int) -> float:
        return self.terms(forwarded, trained, attn_pairs)["total"]


def attended_pairs(leave: Any) -> int:
    """(query, key) pairs a packed row attends: key ``k`` is seen by the queries ``k .. leave[k] - 1``."""
    import torch

    return int((leave - torch.arange(leave.shape[0], device=leave.device)).sum())
