"""The trainer's LM head: which implementation computes a row's token statistics (``model.lm_head_kernel``).

Two implementations with one contract (:class:`~asyncgrpo_cli.model.head_types.HeadStats`):

- ``torch``: the chunked head (``model/chunked_head.py``): tiles of fp32 logits, any device, candidate sets;
- ``triton``: the fused head (``model/fused_head.py``): Triton kernels on CUDA, no logits in memory in forward,
  about 1.5x faster at Qwen3's vocabulary on an H200 (``docs/benchmarks.md``).

``auto`` (the default) runs the fused head on CUDA when Triton imports, and the chunked head otherwise and for
calls with per-position candidate sets (``support_ids``). Before its first use on a device, for each combination
of dtype, hidden size, bias, transform and number of ids, ``auto`` runs the fused head forward and backward on a
small random problem next to the chunked head: a Triton build that cannot compile the kernels there (an older GPU,
too little shared memory for the tile sizes) or that computes them wrong is caught once, logged with the reason,
and the run continues on the chunked head. ``triton`` skips the check and lets any error through.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from asyncgrpo_cli.model import chunked_head, fused_head
from asyncgrpo_cli.model.head_types import HeadStats, LogitTransform

logger = logging.getLogger(__name__)

HEAD_KERNELS = ("auto", "torch", "triton")
"""``model.lm_head_kernel`` values."""
CHECK_TOLERANCE = 5e-2
"""Largest log-prob difference and relative gradient error the first-use check accepts (bf16 on 64 positions is
within ~1e-2; a miscompiled kernel is off by orders of magnitude)."""

_checked: dict[tuple, str | None] = {}


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
    candidate_ids: torch.Tensor | None = None,
    support_ids: torch.Tensor | None = None,
    kernel: str = "auto",
    ids_checked: bool = False,
) -> HeadStats:
    """:func:`~asyncgrpo_cli.model.chunked_head.chunked_token_stats`'s outputs from the head ``kernel`` selects
    (``ids_checked``: the ids' ranges were checked on the host, ``chunked_head.check_ids``)."""
    if kernel not in HEAD_KERNELS:
        raise ValueError(f"model.lm_head_kernel={kernel!r}: use one of {', '.join(HEAD_KERNELS)}")
    kw = dict(
        bias=bias,
        transform=transform,
        candidate_ids=candidate_ids,
        support_ids=support_ids,
        ids_checked=ids_checked,
    )
    if kernel == "torch" or support_ids is not None:
        return chunked_head.chunked_token_stats(hidden, weight, targets, **kw)
    why_not = fused_head.unsupported(hidden, interpreter=kernel == "triton")
    if why_not is not None:
        if kernel == "triton":
            raise ValueError(f"model.lm_head_kernel=triton cannot run: {why_not}; use auto or torch")
        return chunked_head.chunked_token_stats(hidden, weight, targets, **kw)
    num_ids = 1 + (0 if candidate_ids is None else candidate_ids.shape[1])
    if kernel == "auto" and fused_problem(
        hidden.device, weight.dtype, weight.shape[1], bias, transform, num_ids
    ):
        return chunked_head.chunked_token_stats(hidden, weight, targets, **kw)
    cands = chunked_head.checked_candidates(hidden, weight, targets, candidate_ids, None, ids_checked)
    logprobs, entropy, cand_logprobs = fused_head.FusedHeadFunction.apply(
        hidden, weight, bias, targets, cands, transform
    )
    return HeadStats(logprobs, entropy, None if candidate_ids is None else cand_logprobs)


def fused_problem(
    device: torch.device,
    dtype: torch.dtype,
    hidden_size: int,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    num_ids: int,
) -> str | None:
    """Why the fused head must not run for this combination (None: it passed its check), checked once."""
    # What the kernels are compiled for: the transform's value (a temperature) needs no check of its own.
    key = (
        device,
        dtype,
        hidden_size,
        bias is not None,
        transform.scale is None,
        transform.softcap is None,
        num_ids,
    )
    if key not in _checked:
        problem = _check(device, dtype, hidden_size, bias is not None, transform, num_ids)
        if problem is not None:
            logger.warning(
                "model.lm_head_kernel=auto: the fused LM head failed its first-use check on %s (%s, hidden %d, "
                "%d ids): %s. Using the chunked head; set model.lm_head_kernel=torch to skip the check.",
                device,
                str(dtype).removeprefix("torch."),
                hidden_size,
                num_ids,
                problem,
            )
        _checked[key] = problem
    return _checked[key]


def _check(*problem: Any) -> str | None:
    """Forward + backward of both heads on :func:`_both_heads`' ``problem``; None when they agree."""
    with torch.inference_mode(False), torch.enable_grad():  # the first use may be under no_grad / inference
        try:
            results = _both_heads(*problem)
        except Exception as exc:  # a compile or launch failure of this Triton build: reported, never fatal
            text = str(exc).strip().splitlines()
            return f"{type(exc).__name__}: {text[0][:200].rstrip('.') if text else ''}"
    (got, got_grads), (want, want_grads) = results
    err = float((got - want).abs().max())
    if not err <= CHECK_TOLERANCE:
        return f"its log-probs differ from the chunked head's by {err:.3g}"
    for g, w in zip(got_grads, want_grads, strict=True):
        rel = float((g - w).norm() / w.norm().clamp_min(1e-30))
        if not rel <= CHECK_TOLERANCE:
            return f"its gradients differ from the chunked head's by {rel:.3g} (relative)"
    return None


def _both_heads(
    device: torch.device,
    dtype: torch.dtype,
    hidden_size: int,
    with_bias: bool,
    transform: LogitTransform,
    ids: int,
) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """(log-probs, gradients of h, W and b) of the fused and the chunked head on one random problem."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, device=device, generator=gen) * scale
        return x.to(dtype).requires_grad_()

    n, vocab = 64, 300
    leaves = [rand(n, hidden_size), rand(vocab, hidden_size, scale=2 / math.sqrt(hidden_size))]
    leaves.append(rand(vocab, scale=0.1) if with_bias else None)
    targets = torch.randint(0, vocab, (n,), device=device, generator=gen)
    cands = torch.randint(-1, vocab, (n, ids - 1), device=device, generator=gen)
    results = []
    for fn in (
        lambda: fused_head.FusedHeadFunction.apply(*leaves, targets, cands, transform),
        lambda: chunked_head.ChunkedHeadFunction.apply(*leaves, targets, cands, None, transform, 128, 32),
    ):
        logprobs, _, cand = fn()
        live = torch.isfinite(cand)
        loss = logprobs.sum() + torch.where(live, cand, 0).exp().sum()
        grads = torch.autograd.grad(loss, [x for x in leaves if x is not None])
        results.append((logprobs.detach().float(), [g.float() for g in grads]))
    return results
