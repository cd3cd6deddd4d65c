"""Model FLOPs of a training step and the peak they are measured against (``perf/mfu_*``).

Per optimizer step, with N the parameters of the decoder body (without the embedding / LM-head matrix), V the
vocabulary, H the hidden size, and A = layers x heads x head_dim the attention width:

    FLOPs = 6 N · forwarded tokens  +  6 V H · trained tokens  +  12 A · attended (query, key) pairs

(forward + backward: the LM head runs only at trained positions; a packed row's attended pairs are
Σ_k (leave[k] - k) over its DFS intervals, so tree packing's shared prefixes count once). Recomputation
(gradient checkpointing, the head's backward) is not counted, as MFU conventionally does not.
MFU = FLOPs / seconds / ranks / peak; logged only when the peak of the device at the compute dtype is known
(bf16 dense on the GPUs in ``PEAK_BF16_TFLOPS``).
"""

from __future__ import annotations

from typing import Any

PEAK_BF16_TFLOPS = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "B200": 2250.0,
}
"""Dense bf16 peak TFLOP/s by GPU name (SXM parts)."""


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


class StepFlops:
    """FLOPs of a step from its token counts, for one model."""

    def __init__(self, model: Any):
        cfg = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.attn_width = cfg.num_hidden_layers * heads * head_dim
        self.head = cfg.vocab_size * cfg.hidden_size
        matrices = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m}
        self.body = sum(p.numel() for p in model.parameters() if id(p) not in matrices)

    def __call__(self, forwarded: int, trained: int, attn_pairs: int) -> float:
        return 6.0 * self.body * forwarded + 6.0 * self.head * trained + 12.0 * self.attn_width * attn_pairs


def attended_pairs(leave: Any) -> int:
    """(query, key) pairs a packed row attends: key ``k`` is seen by the queries ``k .. leave[k] - 1``."""
    import torch

    return int((leave - torch.arange(leave.shape[0], device=leave.device)).sum())
