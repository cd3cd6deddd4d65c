"""Policy losses against the sampler (the "old policy" is the sampler's log-probs), with masked importance sampling.

Per trained token t with trainer log-prob logπ_t, sampler log-prob logμ_t and advantage A:

    r_t = exp(logπ_t - logμ_t)                              importance ratio (sampler -> trainer)
    m_t = 1[clip_min <= r_t <= clip_max]                    masked IS (detached)

With truncated sampling (top-k / top-p / min-p) logμ_t is normalized over the token's candidate set; when the row
carries the sets (``row.support_ids``) logπ_t is renormalized over the same set by the head, so r_t is unbiased
(``sampling/sampling_mask_frac`` is the fraction of trained tokens that had one).

Normalization: a micro-batch returns Σ_t loss_t / num_trained_step, where num_trained_step counts the trained
tokens of the whole optimizer step (every micro-batch, every rank), IS-masked tokens included, as the clipped
formula's Σ|o_i| does. Accumulated micro-batches therefore sum to exactly the full-batch token mean. Across ranks
the gradients must be SUMMED (or multiplied by world size when the backend averages them).

Each call also returns raw metric material (0-d detached tensors named ``*_sum`` / ``*_count`` / ``*_min`` /
``*_max``): merge it over a step's micro-batches (and ranks: all-reduce SUM / MIN / MAX by suffix) with
:func:`merge_metric_parts`, then turn it into window records with :func:`metric_records` (token means as
(sum, count) pairs, so the window mean is exact) or into values with :func:`finalize_metrics`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from asyncgrpo_cli.config.schema import LossConfig
from asyncgrpo_cli.model.logprobs import TokenStats
from asyncgrpo_cli.packing.row import PackedRow
from asyncgrpo_cli.samples import SAMPLER_TOPK

MAX_LOG_RATIO = 80.0


class _MaskedISLoss(ABC):
    """Shared ratio, IS mask, normalization and metrics; subclasses give the per-token loss and clip flags.

    A :class:`~asyncgrpo_cli.protocols.Loss`: ``needs`` names the token extras it reads from ``row.extras``.
    """

    needs: tuple[str, ...] = ()
    head_temperature: float | None = None  # the sampling temperature

    def __init__(self, cfg: LossConfig) -> None:
        self.cfg = cfg
        self.eps_low = cfg.epsilon
        self.eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
        self.clip_min = cfg.vllm_importance_sampling_clip_min
        self.clip_max = cfg.vllm_importance_sampling_clip_max

    def in_range(self, ratio: torch.Tensor) -> torch.Tensor:
        """m = 1[clip_min <= r <= clip_max] as float, detached."""
        r = ratio.detach()
        return ((r >= self.clip_min) & (r <= self.clip_max)).float()

    def metric_records(
        self, raw: dict[str, torch.Tensor]
    ) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
        return metric_records(raw)

    @abstractmethod
    def token_losses(
        self, stats: TokenStats, row: PackedRow, ratio: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        """Per-token loss [N] and extra raw metrics."""

    @abstractmethod
    def clip_flags(self, ratio: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens counted as clipped at the lower / upper trust-region bound (bool [N])."""

    def __call__(self, stats: TokenStats, row: PackedRow, num_trained_step: int) -> tuple[torch.Tensor, dict]:
        # Clamping the log-ratio keeps r finite in fp32; such tokens are IS-masked (zero gradient) anyway.
        ratio = torch.exp((stats.logprobs - row.sampler_logprobs).clamp(max=MAX_LOG_RATIO))
        mask = self.in_range(ratio)
        per_token, extra = self.token_losses(stats, row, ratio, mask)
        loss = per_token.sum() / max(num_trained_step, 1)
        metrics = _base_metrics(stats, row, ratio, mask)
        metrics.update(_clip_metrics(row, *self.clip_flags(ratio.detach(), row.advantages)))
        metrics.update(extra)
        return loss, metrics


class ClippedLoss(_MaskedISLoss):
    """GRPO clipped surrogate with masked IS.

    loss_t = -m_t · min(r_t A, clip(r_t, 1 - ε_low, 1 + ε_high) A),  ε_high = epsilon_high or epsilon.
    ``clip_ratio/low`` counts tokens on the clipped branch at the lower bound (r < 1 - ε_low and A < 0),
    ``clip_ratio/high`` at the upper bound (r > 1 + ε_high and A > 0), over all trained tokens (IS-masked ones
    included), as GRPOTrainer does.
    """

    def token_losses(
        self, stats: TokenStats, row: PackedRow, ratio: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        adv = row.advantages
        clipped = torch.clamp(ratio, 1 - self.eps_low, 1 + self.eps_high)
        return -mask * torch.minimum(ratio * adv, clipped * adv), {}

    def clip_flags(self, ratio: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (ratio < 1 - self.eps_low) & (adv < 0), (ratio > 1 + self.eps_high) & (adv > 0)


class ScoreCenteringLoss(_MaskedISLoss):
    """Masked IS with score centering over the sampler's top-k (reference f.3); the loss is not clipped.

    Target gradient per trained token, with f(r) = r·1[clip_min <= r <= clip_max]:

        -A ( f(r_t) ∇logπ(o_t) - Σ_{v ∈ topk} μ(v) f(r_v) ∇logπ(v) ),   r_v = π(v) / μ(v)

    Implemented as the surrogate loss_t = -A (m_t r_t - Σ_v m_v π(v)): since ∇r = r ∇logπ and μ(v) r_v = π(v),
    its gradient is exactly the one above (m detached). The value of the surrogate is not itself meaningful.
    Choices (reference open questions 3 and 6):
      - μ(v) are the raw sampler probabilities of the ``num_sampler_logprobs`` tokens the sampler ranked most
        likely (``row.extras["sampler_topk"]``), not renormalized over that subset; the sampled token is in the sum only when it
        is among them. The centering term is kept at IS-masked positions (f zeroes only the sampled token's term).
      - The normalizer counts IS-masked tokens (as the clipped loss does).
      - π(v) uses the same temperature as π(o_t). ``clip_ratio/*`` count tokens outside [1 - ε_low, 1 + ε_high].
      - Truncated sampling (reference j): μ is the sampler's processed distribution, normalized over the token's
        candidate set S. With S known (``row.support_ids``) the head renormalizes π(v) over S too (π(v) = 0 for
        v ∉ S), so both sides of every ratio and of the centering term live on S; a top-N id outside S arrives as
        μ(v) = exp(-9999) = 0 and π(v) = 0 and drops out, so the centering expectation runs over top-N ∩ S and
        ``sampling/sampler_mass`` is the mass of that part of S. Without S, π(v) is a full-vocabulary probability
        against a renormalized μ(v): the same bias as the ratios (warned at startup).
    """

    needs = (SAMPLER_TOPK,)

    def token_losses(
        self, stats: TokenStats, row: PackedRow, ratio: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        topk = row.extras.get(SAMPLER_TOPK)
        if topk is None:  # no sample of the row carries one (a context-only filler): an empty sum, K = 0
            n = row.target_ids.shape[0]
            ids, mu_lp = row.target_ids.new_full((n, 0), -1), row.sampler_logprobs.new_zeros((n, 0))
            pi_lp = mu_lp if stats.topk_logprobs is None else stats.topk_logprobs
        elif stats.topk_logprobs is None:
            raise ValueError(
                "score_centering needs the trainer's top-k log-probs: call token_logprobs(with_topk=True)"
            )
        else:
            ids, mu_lp, pi_lp = topk.ids, topk.logprobs, stats.topk_logprobs
        pi_v = torch.exp(pi_lp)  # 0 at padding (-inf)
        mu_v = torch.exp(mu_lp)
        ratio_v = (pi_v / mu_v.clamp_min(torch.finfo(mu_v.dtype).tiny)).detach()
        mask_v = ((ratio_v >= self.clip_min) & (ratio_v <= self.clip_max) & (ids >= 0)).float()
        baseline = (mask_v * pi_v).sum(-1)
        extra = {"sampler_mass_sum": mu_v.sum(-1).sum().detach()}
        return -row.advantages * (mask * ratio - baseline), extra

    def clip_flags(self, ratio: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ratio < 1 - self.eps_low, ratio > 1 + self.eps_high


def _base_metrics(stats: TokenStats, row: PackedRow, ratio: torch.Tensor, mask: torch.Tensor) -> dict:
    r = ratio.detach()
    diff = (stats.logprobs.detach() - row.sampler_logprobs).abs()
    extra = {}
    if row.support_ids is not None:  # tokens whose log-prob was renormalized over a candidate set
        extra["sampling_mask_sum"] = (row.support_ids >= 0).any(1).float().sum()
    return extra | {
        "token_count": torch.full((), float(r.numel()), device=r.device),  # a fill kernel, not a host copy
        "is_ratio_sum": r.sum(),
        "is_ratio_min": _extreme(r, torch.min, float("inf")),
        "is_ratio_max": _extreme(r, torch.max, float("-inf")),
        "is_masked_sum": (1 - mask).sum(),
        "logp_diff_sum": diff.sum(),
        "logp_diff_max": _extreme(diff, torch.max, float("-inf")),
        "entropy_sum": stats.entropy.detach().sum(),
    }


def _clip_metrics(row: PackedRow, low: torch.Tensor, high: torch.Tensor) -> dict:
    """Token counts, and the smallest / largest per-sample fraction over samples with trained tokens.

    Samples without trained tokens take the reduction's identity (inf / -inf) through ``masked_fill`` rather than
    being left out by a boolean index: selecting by a mask needs the selected count on the host, a device sync in the
    middle of every row's loss that would hold the CPU until the row's forward finished."""
    idx = row.sample_index
    n = torch.zeros(row.num_samples, device=low.device).index_add_(
        0, idx, torch.ones_like(low, dtype=torch.float)
    )
    has = n > 0
    per = n.clamp(min=1)
    low_frac = torch.zeros_like(n).index_add_(0, idx, low.float()) / per
    high_frac = torch.zeros_like(n).index_add_(0, idx, high.float()) / per
    return {
        "clip_low_sum": low.float().sum(),
        "clip_high_sum": high.float().sum(),
        "clip_region_sum": (low | high).float().sum(),
        "clip_low_sample_min": _extreme(low_frac.masked_fill(~has, float("inf")), torch.min, float("inf")),
        "clip_high_sample_max": _extreme(
            high_frac.masked_fill(~has, float("-inf")), torch.max, float("-inf")
        ),
    }


def _extreme(x: torch.Tensor, op, empty: float) -> torch.Tensor:
    return op(x) if x.numel() else torch.full((), empty, device=x.device)


def merge_metric_parts(parts: list[dict]) -> dict[str, torch.Tensor]:
    """Combine raw material from several calls: ``*_min`` by min, ``*_max`` by max, everything else by sum."""
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part.items():
            if key not in merged:
                merged[key] = value.detach().clone()
            elif key.endswith("_min"):
                merged[key] = torch.minimum(merged[key], value)
            elif key.endswith("_max"):
                merged[key] = torch.maximum(merged[key], value)
            else:
                merged[key] = merged[key] + value
    return merged


_MEANS = {
    "sampling/importance_sampling_ratio/mean": "is_ratio_sum",
    "sampling/masked_mean": "is_masked_sum",
    "sampling/sampling_logp_difference/mean": "logp_diff_sum",
    "sampling/sampler_mass": "sampler_mass_sum",
    "sampling/sampling_mask_frac": "sampling_mask_sum",
    "entropy": "entropy_sum",
    "clip_ratio/region_mean": "clip_region_sum",
    "clip_ratio/low_mean": "clip_low_sum",
    "clip_ratio/high_mean": "clip_high_sum",
}
_EXTREMES = {
    "sampling/importance_sampling_ratio/min": "is_ratio_min",
    "sampling/importance_sampling_ratio/max": "is_ratio_max",
    "sampling/sampling_logp_difference/max": "logp_diff_max",
    "clip_ratio/low_min": "clip_low_sample_min",
    "clip_ratio/high_max": "clip_high_sample_max",
}


def metric_records(
    raw: dict[str, torch.Tensor],
) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """Merged raw material as window records: token means as (sum, trained tokens) pairs, and extremes.

    Feeding the pairs to a ratio aggregator (Σ sums / Σ tokens over the window) gives the exact token mean of the
    window. Metrics with no trained token behind them are left out.
    """
    count = float(raw["token_count"])
    rates = (
        {name: (float(raw[key]), count) for name, key in _MEANS.items() if key in raw} if count > 0 else {}
    )
    extremes = {name: float(raw[key]) for name, key in _EXTREMES.items() if math.isfinite(float(raw[key]))}
    return rates, extremes


def finalize_metrics(raw: dict[str, torch.Tensor]) -> dict[str, float]:
    """Metric names and values from merged raw material (token means over the trained tokens, and extremes)."""
    rates, extremes = metric_records(raw)
    return {name: num / den for name, (num, den) in rates.items()} | extremes
