"""Fused LM head: the chunked head's statistics (``model/chunked_head.py``) from cuBLAS matmuls and two Triton
kernels, with one fp32 chunk of logits in memory in forward and one bf16 tile of logit gradients in backward.

Same contract and formulas as :class:`~asyncgrpo_cli.model.chunked_head.ChunkedHeadFunction` (read its module
doc for z, log Z, the entropy and the candidate log-probs); what differs is where the work runs:

- **Forward** (``stats_kernel``): cuBLAS writes the raw logits of a chunk of positions (all of the vocabulary,
  at most ``STATS_TILE_ELEMENTS``, 512 MiB) in fp32 (``torch.mm(..., out_dtype=torch.float32)``: fp32
  accumulation, no rounding to bf16); one program per row then applies the transform (bias, scale, soft-cap,
  1/T), keeps the online logsumexp state (running max m, Σ e^(z-m), Σ e^(z-m)·z) over ``STATS_BLOCK_V``-wide
  blocks and loads the logits at the target and candidate ids, and writes log Z, the entropy and those logits.
  An earlier forward did the matmul inside a Triton kernel too, the logits never leaving registers; cuBLAS's
  matmul runs near the GPU's peak and Triton's at about half of it, so the fp32 round trip is the faster way:
  forward 19.6 vs 34.6 ms for 16,384 positions x 2,048 x 151,936 on an H200 (docs/benchmarks.md). The chunked
  head needs ~25 element-wise launches and several fp32 [n, v] round trips per tile for the same numbers.
- **Backward** (``grad_kernel``): one program per [BLOCK_N, BLOCK_V] block of a tile recomputes the block's
  logits the same way and writes the dense part of ∂L/∂x, -G·p_v·∂z/∂x, in the weight dtype into a [positions,
  vocab] tile buffer (at most ``GRAD_TILE_ELEMENTS`` entries, 256 MiB in bf16). The target and candidate columns
  are then overwritten with their exact value ∂z/∂x·(Σ_{j: id_j = v} g_j - G·p_v), computed in fp32 from the
  forward's picked logits (an ``index_put_`` of N x (1 + K) entries; adding g to the rounded dense value instead
  would cancel catastrophically in bf16 where p_target is close to 1). Two cuBLAS matmuls per tile then give
  grad_h += ∂L/∂x · W_tile (accumulated in fp32 by the matmul itself, :func:`accumulate_mm`) and
  grad_W_tile += ∂L/∂xᵀ · h, as in the chunked head.

Logits are accumulated and kept in fp32 (the chunked and dense heads round the matmul's output to the weight
dtype first), so bf16 results differ from theirs by that rounding; fp32 inputs run the dot in IEEE fp32
(no TF32) and agree to rounding. Candidate sets (``support_ids``) are not handled here: ``model/head.py`` runs
the chunked head for them, and chooses between the two heads (``model.lm_head_kernel``).

Hand-written because no maintained library kernel computes this set of outputs: fused linear cross-entropy
kernels (Liger, Apple's cut-cross-entropy) return the target's log-prob or a reduced loss, not the entropy and
the log-probs of a second set of ids per position, and they are not differentiable through those. On machines
without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the CPU tests
check them against the chunked head.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from asyncgrpo_cli.model.head_types import LogitTransform

GRAD_TILE_ELEMENTS = 1 << 27
"""Largest [positions, vocab] gradient tile backward writes (2^27 entries: 256 MiB in bf16)."""
GRAD_VOCAB_CHUNK = 16384
"""Vocabulary entries per backward tile."""
SPARE = 8
"""Columns past each backward tile that absorb the id entries outside it."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unsupported(hidden: torch.Tensor, interpreter: bool = False) -> str | None:
    """Why the fused head cannot run on ``hidden``'s device (None when it can). With ``interpreter`` (an explicit
    ``triton`` choice), CPU tensors run under Triton's interpreter when ``TRITON_INTERPRET=1`` (tests)."""
    if hidden.device.type != "cuda" and not (interpreter and _interpreting()):
        return f"the fused head runs on CUDA (hidden states are on {hidden.device.type})"
    return fused_missing()


def head_that_runs(kernel: str, device: torch.device | str) -> str:
    """``model.lm_head_kernel`` -> the head that runs on ``device`` (rows without candidate sets): triton or torch."""
    if kernel == "torch":
        return "torch"
    if kernel == "triton" or (torch.device(device).type == "cuda" and fused_missing() is None):
        return "triton"
    return "torch"


@functools.cache
def fused_missing() -> str | None:
    """None when this install can run the fused head, else the reason (the message names the fix): Triton must
    import, and ``torch.mm`` must write fp32 from bf16 / fp16 inputs (``out_dtype``, torch >= 2.8) for the
    forward's raw logits."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        return f"Triton is not installed ({exc}); install triton or set model.lm_head_kernel=torch"
    if "dtype_out" in torch.ops.aten.mm.overloads():
        return None
    return (  # pragma: no cover - depends on the install
        f"torch {torch.__version__} has no torch.mm(..., out_dtype=torch.float32) (torch >= 2.8 has); upgrade torch "
        "or set model.lm_head_kernel=torch"
    )


# ------------------------------------------------------------------------------------------------- kernels
def _kernels() -> Any:
    """The Triton kernels' module (Triton is imported only when the fused head runs)."""
    from asyncgrpo_cli.model import fused_head_kernels

    return fused_head_kernels


GRAD_BLOCKS = dict(BLOCK_N=128, BLOCK_V=256, BLOCK_D=64, num_warps=8, num_stages=3)
"""Tile sizes and launch options of ``grad_kernel`` on GPUs (measured on an H200: docs/benchmarks.md)."""


def _blocks(dtype: torch.dtype, tuned: dict[str, int]) -> dict[str, Any]:
    """Tile sizes and launch options: small blocks under the interpreter (numpy), ``tuned`` on GPUs."""
    precision = "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    if _interpreting():
        return dict(BLOCK_N=16, BLOCK_V=32, BLOCK_D=16, PRECISION=precision)
    return dict(tuned, PRECISION=precision)


STATS_TILE_ELEMENTS = 1 << 27
"""fp32 raw logits per forward chunk (512 MiB): 883 positions of Qwen3's 151,936-entry vocabulary."""
STATS_LAUNCH = dict(BLOCK_V=2048, num_warps=8)
"""``stats_kernel``'s vocabulary entries per block of its row loop and launch options on GPUs (``BLOCK_V=128``
under the interpreter)."""


def _transform_args(transform: LogitTransform) -> dict[str, Any]:
    return dict(
        scale=1.0 if transform.scale is None else float(transform.scale),
        softcap=1.0 if transform.softcap is None else float(transform.softcap),
        inv_temp=1.0 / float(transform.temperature),
        HAS_SCALE=transform.scale is not None,
        HAS_SOFTCAP=transform.softcap is not None,
    )


def _stats_from_cublas(h, w, bias, ids, transform: LogitTransform):
    """(log Z, entropy, transformed logits at ids [N, 1 + K], -inf for absent candidates): per chunk of
    positions, cuBLAS's fp32 raw logits, then ``stats_kernel`` reduces each row in one pass."""
    n_pos, vocab, num_ids = h.shape[0], w.shape[0], ids.shape[1]
    f32 = dict(dtype=torch.float32, device=h.device)
    log_z, entropy = torch.empty(n_pos, **f32), torch.empty(n_pos, **f32)
    picked = torch.empty(n_pos, num_ids, **f32)
    rows = max(1, min(n_pos, STATS_TILE_ELEMENTS // vocab))
    tile = torch.empty(rows, vocab, **f32)
    launch = dict(BLOCK_V=128) if _interpreting() else STATS_LAUNCH
    for p0 in range(0, n_pos, rows):
        p1 = min(p0 + rows, n_pos)
        raw = raw_logits(h[p0:p1], w, tile[: p1 - p0])
        _kernels().stats_kernel[(p1 - p0,)](
            raw, w if bias is None else bias, ids, log_z, entropy, picked, p0, raw.stride(0),
            VOCAB=vocab, HAS_BIAS=bias is not None, NUM_IDS=num_ids,
            IDS_P=max(2, 1 << (num_ids - 1).bit_length()), **_transform_args(transform), **launch,
        )  # fmt: skip
    return log_z, entropy, picked


def raw_logits(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """h @ wᵀ into the fp32 ``out``: cuBLAS accumulates in fp32 and writes fp32 (no bf16 rounding) on CUDA."""
    if h.is_cuda and h.dtype != torch.float32:
        return torch.mm(h, w.T, out_dtype=torch.float32, out=out)
    return torch.mm(h.float(), w.float().T, out=out)


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for an fp32 ``acc``. On CUDA with 16-bit ``a`` / ``b``, one cuBLAS call adds the product
    into ``acc`` in its epilogue (``addmm`` with fp32 output, beta = 1): no rounding of each tile's product to the
    weight dtype and no separate fp32 add over ``acc`` (the backward's largest element-wise pass, once per
    vocabulary tile). Elsewhere the product, then the add."""
    if acc.is_cuda and a.dtype != torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += a @ b


# ------------------------------------------------------------------------------------------------- autograd
class FusedHeadFunction(torch.autograd.Function):
    """(hidden, weight, bias, targets, candidate_ids, transform) -> (logprobs, entropy, candidate_logprobs)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, candidate_ids, transform: LogitTransform):
        h = hidden.to(weight.dtype).contiguous()
        w = weight.contiguous()
        ids = torch.cat([targets[:, None], candidate_ids], dim=1).contiguous()  # [N, 1 + K], int64
        log_z, entropy, picked = _stats_from_cublas(h, w, bias, ids, transform)
        out = picked - log_z[:, None]
        logprobs, cand_logprobs = out[:, 0].contiguous(), out[:, 1:].contiguous()
        ctx.save_for_backward(hidden, weight, bias, ids, picked, log_z)
        ctx.transform = transform
        ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return logprobs, entropy, cand_logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logprobs, _g_entropy, g_cand):
        hidden, weight, bias, ids, picked, log_z = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (g_logprobs is None and g_cand is None) or not (need_h or need_w or need_b):
            return (None,) * 6
        n_pos, n_hidden = hidden.shape
        if n_pos == 0:  # a row with nothing trained: zero gradients (no tile ever writes grad_w)
            zeros = [torch.zeros_like(x) if need and x is not None else None for x, need in zip(
                (hidden, weight, bias), (need_h, need_w, need_b), strict=True)]  # fmt: skip
            return (*zeros, None, None, None)
        grad_kernel = _kernels().grad_kernel
        vocab = weight.shape[0]
        transform = ctx.transform
        f32 = dict(dtype=torch.float32, device=hidden.device)
        live = torch.isfinite(picked)  # [N, 1 + K]; the target is always live
        g_t = torch.zeros(n_pos, **f32) if g_logprobs is None else g_logprobs.float()
        g_k = torch.zeros(n_pos, ids.shape[1] - 1, **f32) if g_cand is None else g_cand.float()
        g_ids = torch.where(live, torch.cat([g_t[:, None], g_k], dim=1), 0.0)
        g_total = g_ids.sum(1).contiguous()  # G
        # Exact ∂L/∂x at the id columns: Σ of g over the ids equal to this one (a candidate may be the target),
        # minus G·p, times the slope, all in fp32.
        same = ids[:, :, None] == ids[:, None, :]
        g_same = (same * g_ids[:, None, :]).sum(2)
        z_ids = torch.where(live, picked, 0.0)
        slope_factor = (1.0 if transform.scale is None else transform.scale) / transform.temperature
        slope = transform.slope(z_ids) if transform.softcap is not None else slope_factor
        exact = torch.where(
            live, (g_same - g_total[:, None] * torch.exp(z_ids - log_z[:, None])) * slope, 0.0
        )
        h = hidden.to(weight.dtype).contiguous()
        w = weight.contiguous()
        blocks = _blocks(w.dtype, GRAD_BLOCKS)
        vocab_chunk = min(vocab, GRAD_VOCAB_CHUNK)
        position_chunk = max(1, min(n_pos, GRAD_TILE_ELEMENTS // vocab_chunk))
        grad_h = torch.zeros(hidden.shape, **f32) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if need_b else None
        # SPARE columns past the tile take the id entries that fall outside it (no host sync to filter them);
        # 8 of them keep every row 16-byte aligned for cuBLAS.
        dx_buffer = torch.empty(position_chunk, vocab_chunk + SPARE, dtype=w.dtype, device=hidden.device)
        row_index = torch.arange(position_chunk, device=hidden.device)[:, None].expand(-1, ids.shape[1])
        for v0 in range(0, vocab, vocab_chunk):
            v1 = min(v0 + vocab_chunk, vocab)
            w_tile = w[v0:v1]
            gw = torch.zeros(v1 - v0, n_hidden, **f32) if need_w and position_chunk < n_pos else None
            gb = torch.zeros(v1 - v0, **f32) if need_b else None
            for p0 in range(0, n_pos, position_chunk):
                p1 = min(p0 + position_chunk, n_pos)
                dx = dx_buffer[: p1 - p0, : v1 - v0]
                grid = (-(-(p1 - p0) // blocks["BLOCK_N"]), -(-(v1 - v0) // blocks["BLOCK_V"]))
                grad_kernel[grid](
                    h[p0:p1], w, w if bias is None else bias, g_total[p0:p1], log_z[p0:p1], dx,
                    p1 - p0, v1 - v0, h.stride(0), w.stride(0), dx.stride(0), v0,
                    slope_factor=slope_factor, HIDDEN=n_hidden, HAS_BIAS=bias is not None,
                    **_transform_args(transform), **blocks,
                )  # fmt: skip
                local = ids[p0:p1] - v0
                inside = (local >= 0) & (local < v1 - v0) & live[p0:p1]
                cols = torch.where(inside, local, vocab_chunk)
                dx_buffer[: p1 - p0].index_put_((row_index[: p1 - p0], cols), exact[p0:p1].to(w.dtype))
                if need_h:
                    accumulate_mm(grad_h[p0:p1], dx, w_tile)
                if need_w:
                    if gw is None:
                        grad_w[v0:v1] = dx.T @ h[p0:p1]  # one chunk of positions: cuBLAS accumulates in fp32
                    else:
                        accumulate_mm(gw, dx.T, h[p0:p1])
                if need_b:
                    gb += dx.sum(0, dtype=torch.float32)
            if gw is not None:
                grad_w[v0:v1] = gw
            if need_b:
                grad_b[v0:v1] = gb
        grad_h = grad_h.to(hidden.dtype) if need_h else None
        return grad_h, grad_w, grad_b, None, None, None
