"""Chunked LM head: target log-probs, entropies and candidate log-probs without ever forming [N, V] logits.

For N positions with hidden states h [N, H], head weight W [V, H] (the input embedding for tied models), optional
bias b [V], and the head transform of the model (logit scale s, final soft-cap c, temperature T):

    x = h Wᵀ + b                        raw logits (matmul in the weights' dtype, then fp32)
    z = c · tanh(s·x / c) / T           fp32; without soft-capping z = s·x / T
    log Z = logsumexp_v z_v             over the vocabulary, or over a per-position candidate set S (below)
    logprob   = z_t - log Z             t = target id
    entropy   = log Z - Σ_v p_v z_v     p = exp(z - log Z); logged only (no gradient)
    cand[k]   = z_{c_k} - log Z         sampler top-k ids c_k; -inf where c_k = -1 (absent) or c_k ∉ S

Forward: positions in chunks of ``position_chunk``; for each, the vocabulary in chunks of ``vocab_chunk``. Each
[n, v] tile of fp32 logits updates an online logsumexp (running max m, Σ exp(z - m), Σ exp(z - m)·z):

    m' = max(m, max_v z_v),   s' = s·e^(m - m') + Σ_v e^(z_v - m'),   a' = a·e^(m - m') + Σ_v e^(z_v - m') z_v
    log Z = m + log s,        Σ_v p_v z_v = a / s

and the target and candidate logits are picked out of the tile that holds them (the same fp32 values that enter
log Z, so logprob <= 0 exactly as in the dense computation). Only h, W, b, the ids and log Z [N] are saved.

Backward recomputes every tile (vocabulary chunks outside, position chunks inside) and, with upstream gradients
g_t (target log-probs) and g_k (candidate log-probs, 0 where the output is -inf), G = g_t + Σ_k g_k:

    ∂L/∂z_v = g_t·1[v = t] + Σ_k g_k·1[v = c_k] - G·p_v
    ∂z/∂x   = s/T · (1 - tanh²(s·x / c))  =  s/T · (1 - (z·T / c)²)          (s/T without soft-capping)
    grad_h += (∂L/∂x) W_chunk,   grad_W_chunk += (∂L/∂x)ᵀ h,   grad_b_chunk += Σ_n ∂L/∂x

grad_h ([N, H]) and each vocabulary chunk's grad_W / grad_b are accumulated in fp32 and cast to the inputs'
dtypes once. For bf16 inputs the matmuls run in bf16 (as the dense head's do); everything else is fp32.

Top-k / top-p renormalization hook: ``support_ids`` [N, C] (padding -1) gives each position the candidate set S
the sampler drew from; log Z, the entropy and the candidate log-probs are then taken over S (logits outside S are
-inf), so logprob_t = z_t - logsumexp_{v ∈ S} z_v. A row of only -1 keeps the full vocabulary for that position.
The target must be in S (the sampler drew it from there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from asyncgrpo_cli.model.head_types import HeadStats, LogitTransform

VOCAB_CHUNK = 4096
"""Vocabulary entries per tile on CPU. A tile holds a few [positions, vocab] fp32 temporaries."""
POSITION_CHUNK = 1024
"""Positions per tile on CPU (16 MiB fp32 temporaries)."""
CUDA_VOCAB_CHUNK = 16384
"""Vocabulary entries per tile on CUDA."""
CUDA_POSITION_CHUNK = 4096
"""Positions per tile on CUDA (256 MiB fp32 temporaries). Each tile costs ~25 kernel launches; small tiles leave
the GPU waiting on Python (measured on an H200, 16k positions x 151,936 vocab: 1024 x 4096 tiles took 490 ms
forward+backward, 8x the naive head)."""


def tile_shape(device: torch.device) -> tuple[int, int]:
    """(position_chunk, vocab_chunk) for tiles on ``device``."""
    if device.type == "cuda":
        return CUDA_POSITION_CHUNK, CUDA_VOCAB_CHUNK
    return POSITION_CHUNK, VOCAB_CHUNK


# ------------------------------------------------------------------------------------------------- tiles
def _raw_tile(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, v0: int, v1: int
) -> torch.Tensor:
    """x = h W[v0:v1]ᵀ + b[v0:v1] in the weights' dtype (autocast off, so the backward recomputes the same)."""
    with torch.autocast(h.device.type, enabled=False):
        return F.linear(h, weight[v0:v1], None if bias is None else bias[v0:v1])


def _local(ids: torch.Tensor, v0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each id inside the tile [v0, v0 + width) (clamped into range) and whether it falls there."""
    local = ids - v0
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), inside


def _support_mask(support: torch.Tensor, v0: int, width: int) -> torch.Tensor:
    """bool [n, width]: True where the vocabulary entry is in the position's candidate set (all True if none)."""
    n = support.shape[0]
    local = support - v0
    inside = (local >= 0) & (local < width)
    mask = torch.zeros(n, width + 1, dtype=torch.bool, device=support.device)
    mask.scatter_(1, torch.where(inside, local, width), True)  # ids outside the tile land in the spare column
    return mask[:, :width] | (support < 0).all(1, keepdim=True)


def _tile(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    v0: int,
    v1: int,
    transform: LogitTransform,
    support: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits z of the tile, and the same with -inf outside each position's candidate set."""
    z = transform(_raw_tile(h, weight, bias, v0, v1))
    if support is None:
        return z, z
    return z, z.masked_fill(~_support_mask(support, v0, v1 - v0), float("-inf"))


# ------------------------------------------------------------------------------------------------- autograd
class ChunkedHeadFunction(torch.autograd.Function):
    """(hidden, weight, bias, targets, candidate_ids, support_ids, ...) -> (logprobs, entropy, candidate_logprobs).

    ``candidate_ids`` is always a [N, K] tensor here (K may be 0); see :func:`chunked_token_stats`.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        candidate_ids: torch.Tensor,
        support_ids: torch.Tensor | None,
        transform: LogitTransform,
        vocab_chunk: int,
        position_chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n_pos, vocab = hidden.shape[0], weight.shape[0]
        h_all = hidden.to(weight.dtype)
        ids_all = torch.cat([targets[:, None], candidate_ids], dim=1)  # [N, 1 + K]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        log_z = torch.empty(n_pos, **f32)
        entropy = torch.empty(n_pos, **f32)
        picked = torch.full(ids_all.shape, float("-inf"), **f32)  # z at the target and candidate ids
        for p0 in range(0, n_pos, position_chunk):
            p1 = min(p0 + position_chunk, n_pos)
            h, ids = h_all[p0:p1], ids_all[p0:p1]
            support = None if support_ids is None else support_ids[p0:p1]
            run_max = torch.full((p1 - p0,), float("-inf"), **f32)
            run_sum = torch.zeros(p1 - p0, **f32)
            run_dot = torch.zeros(p1 - p0, **f32)
            for v0 in range(0, vocab, vocab_chunk):
                v1 = min(v0 + vocab_chunk, vocab)
                z, z_in = _tile(h, weight, bias, v0, v1, transform, support)
                new_max = torch.maximum(run_max, z_in.amax(1))
                base = torch.where(torch.isfinite(new_max), new_max, 0.0)  # rows with nothing in S so far
                decay = torch.exp(run_max - base)
                e = (z_in - base[:, None]).exp_()
                run_sum = run_sum * decay + e.sum(1)
                run_dot = run_dot * decay + (e * z).sum(1)  # e = 0 outside S, where z stays finite
                run_max = new_max
                local, inside = _local(ids, v0, v1 - v0)
                picked[p0:p1] = torch.where(inside, z_in.gather(1, local), picked[p0:p1])
            log_z[p0:p1] = run_max + run_sum.log()
            entropy[p0:p1] = log_z[p0:p1] - run_dot / run_sum
        out = picked - log_z[:, None]
        logprobs, cand_logprobs = out[:, 0].contiguous(), out[:, 1:].contiguous()
        ctx.save_for_backward(hidden, weight, bias, targets, candidate_ids, support_ids, log_z)
        ctx.cand_live = torch.isfinite(cand_logprobs)  # bool [N, K]; -inf outputs are constants
        ctx.transform, ctx.vocab_chunk, ctx.position_chunk = transform, vocab_chunk, position_chunk
        ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return logprobs, entropy, cand_logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logprobs: torch.Tensor | None, _g_entropy: None, g_cand: torch.Tensor | None):
        hidden, weight, bias, targets, candidate_ids, support_ids, log_z = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n_pos, vocab = hidden.shape[0], weight.shape[0]
        if (g_logprobs is None and g_cand is None) or not (need_h or need_w or need_b):
            return (None,) * 9
        f32 = dict(dtype=torch.float32, device=hidden.device)
        g_t = torch.zeros(n_pos, **f32) if g_logprobs is None else g_logprobs.float()
        g_k = torch.zeros(candidate_ids.shape, **f32) if g_cand is None else g_cand.float()
        g_k = torch.where(ctx.cand_live, g_k, 0.0)
        g_ids = torch.cat([g_t[:, None], g_k], dim=1)  # [N, 1 + K]
        g_total = g_ids.sum(1)  # G
        ids_all = torch.cat([targets[:, None], candidate_ids], dim=1)
        h_all = hidden.to(weight.dtype)
        grad_h = torch.zeros(hidden.shape, **f32) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if need_b else None
        for v0 in range(0, vocab, ctx.vocab_chunk):
            v1 = min(v0 + ctx.vocab_chunk, vocab)
            w = weight[v0:v1]
            gw = torch.zeros(v1 - v0, weight.shape[1], **f32) if need_w else None
            gb = torch.zeros(v1 - v0, **f32) if need_b else None
            for p0 in range(0, n_pos, ctx.position_chunk):
                p1 = min(p0 + ctx.position_chunk, n_pos)
                h = h_all[p0:p1]
                support = None if support_ids is None else support_ids[p0:p1]
                z, z_in = _tile(h, weight, bias, v0, v1, ctx.transform, support)
                # ∂L/∂z = -G·p, plus g at the target and candidate columns that fall in this tile
                grad_z = (z_in - log_z[p0:p1, None]).exp_().mul_(-g_total[p0:p1, None])
                local, inside = _local(ids_all[p0:p1], v0, v1 - v0)
                grad_z.scatter_add_(1, local, torch.where(inside, g_ids[p0:p1], 0.0))
                grad_x = grad_z.mul_(ctx.transform.slope(z))
                gx = grad_x.to(weight.dtype)
                if need_h:
                    grad_h[p0:p1] += gx @ w
                if need_w:
                    gw += gx.T @ h
                if need_b:
                    gb += grad_x.sum(0)
            if need_w:
                grad_w[v0:v1] = gw
            if need_b:
                grad_b[v0:v1] = gb
        grad_h = grad_h.to(hidden.dtype) if need_h else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------- entry points
def checked_candidates(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    candidate_ids: torch.Tensor | None,
    support_ids: torch.Tensor | None,
    ids_checked: bool = False,
) -> torch.Tensor:
    """``candidate_ids`` as the [N, K] tensor the head functions take (K = 0 for None), after :func:`check_inputs`
    (its id ranges skipped when ``ids_checked``: the caller ran :func:`check_ids` on the host copies)."""
    cands = candidate_ids
    if cands is None:
        cands = torch.empty(hidden.shape[0], 0, dtype=torch.long, device=hidden.device)
    check_inputs(hidden, weight, targets, cands, support_ids, ids=not ids_checked)
    return cands


def check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    candidate_ids: torch.Tensor,
    support_ids: torch.Tensor | None,
    ids: bool = True,
) -> None:
    """Shapes, and with ``ids`` the id ranges of :func:`check_ids` (one device sync on a GPU)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [N, H] and [V, H]"
        )
    if targets.shape != (n,) or candidate_ids.ndim != 2 or candidate_ids.shape[0] != n:
        raise ValueError(
            f"targets {tuple(targets.shape)} / candidate_ids {tuple(candidate_ids.shape)} need N={n}"
        )
    if support_ids is not None and (support_ids.ndim != 2 or support_ids.shape[0] != n):
        raise ValueError(f"support_ids {tuple(support_ids.shape)} must be [N={n}, C]")
    if ids:
        check_ids(vocab, targets, candidate_ids, support_ids)


def check_ids(
    vocab: int, targets: torch.Tensor, candidate_ids: torch.Tensor | None, support_ids: torch.Tensor | None
) -> None:
    """Every id in [0, vocab) (-1 allowed as padding in ``candidate_ids`` / ``support_ids``) and every target in
    its candidate set; ValueError naming the first problem. One read of the results: free on host tensors (the
    trainer checks each packed row before its copy to the GPU), a device sync on GPU tensors. An id out of range
    would otherwise reach the head's gathers and kernels (a device-side assert, or garbage)."""
    problems = {
        f"a target id is outside the vocabulary [0, {vocab})": (targets < 0) | (targets >= vocab),
    }
    if candidate_ids is not None:
        problems[f"a candidate id is outside [0, {vocab}) (padding is -1)"] = (candidate_ids < -1) | (
            candidate_ids >= vocab
        )
    if support_ids is not None:
        has_set = (support_ids >= 0).any(1)
        in_set = (support_ids == targets[:, None]).any(1)
        problems[f"a support id is outside [0, {vocab}) (padding is -1)"] = (support_ids < -1) | (
            support_ids >= vocab
        )
        problems["a target id is not in its position's candidate set (support_ids)"] = has_set & ~in_set
    found = torch.stack([bad.any() for bad in problems.values()]).tolist()
    for message, is_bad in zip(problems, found, strict=True):
        if is_bad:
            raise ValueError(message)


def chunked_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
    candidate_ids: torch.Tensor | None = None,
    support_ids: torch.Tensor | None = None,
    vocab_chunk: int | None = None,
    position_chunk: int | None = None,
    ids_checked: bool = False,
) -> HeadStats:
    """Log-probs of ``targets`` [N], entropies and log-probs of ``candidate_ids`` [N, K] (-1 = absent) under
    softmax(transform(hidden Wᵀ + b)), optionally renormalized over ``support_ids`` [N, C] (see the module doc).

    Never forms more than a [position_chunk, vocab_chunk] tile of logits; gradients flow to hidden, weight and
    bias through the log-probs and candidate log-probs. ``candidate_logprobs`` is None when no ids are given.
    Chunk sizes default by device (:func:`tile_shape`). The trainer reaches this through ``model/head.py``, which
    runs the fused Triton head instead where it can (``model.lm_head_kernel``). ``ids_checked``: the caller ran
    :func:`check_ids` on host copies of the ids, so the device sync of that check is skipped here.
    """
    default_positions, default_vocab = tile_shape(hidden.device)
    vocab_chunk = default_vocab if vocab_chunk is None else vocab_chunk
    position_chunk = default_positions if position_chunk is None else position_chunk
    if vocab_chunk < 1 or position_chunk < 1:
        raise ValueError(f"chunk sizes must be positive, got vocab {vocab_chunk}, positions {position_chunk}")
    cands = checked_candidates(hidden, weight, targets, candidate_ids, support_ids, ids_checked)
    logprobs, entropy, cand_logprobs = ChunkedHeadFunction.apply(
        hidden, weight, bias, targets, cands, support_ids, transform, vocab_chunk, position_chunk
    )
    return HeadStats(logprobs, entropy, None if candidate_ids is None else cand_logprobs)


def dense_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
    candidate_ids: torch.Tensor | None = None,
    support_ids: torch.Tensor | None = None,
) -> HeadStats:
    """The naive head with the same contract: full [N, V] fp32 logits, log_softmax, autograd keeps them.

    The reference for tests and the baseline of ``asyncgrpo bench lm-head``.
    """
    z = transform(F.linear(hidden.to(weight.dtype), weight, bias))
    if support_ids is not None:
        z = z.masked_fill(~_support_mask(support_ids, 0, weight.shape[0]), float("-inf"))
    logp = torch.log_softmax(z, dim=-1)
    logprobs = logp.gather(1, targets[:, None]).squeeze(1)
    with torch.no_grad():
        entropy = -torch.special.xlogy(logp.exp(), logp.exp()).sum(1)
    cand = None
    if candidate_ids is not None:
        cand = logp.gather(1, candidate_ids.clamp(min=0)).masked_fill(candidate_ids < 0, float("-inf"))
    return HeadStats(logprobs, entropy, cand)


def pad_candidate_sets(
    sets: Sequence[Sequence[int] | None], device: torch.device | str | None = None
) -> torch.Tensor:
    """Per-position candidate sets (e.g. the server's sampling masks) as ``support_ids``: int64 [N, C], padded
    with -1 to the largest set. An empty set or None becomes a row of -1 (normalize over the full vocabulary)."""
    width = max((len(s) for s in sets if s is not None), default=0)
    out = torch.full((len(sets), width), -1, dtype=torch.long)
    for i, ids in enumerate(sets):
        if ids:
            out[i, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
    return out.to(device) if device is not None else out
