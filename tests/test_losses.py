"""Losses against hand-computed values and gradients, score-centering gradient, exact accumulation, metrics."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo_cli.config.schema import LossConfig
from asyncgrpo_cli.model.logprobs import TokenStats
from asyncgrpo_cli.packing.row import PackedRow
from asyncgrpo_cli.registry import resolve
from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK
from asyncgrpo_cli.train.losses import (
    ClippedLoss,
    ScoreCenteringLoss,
    finalize_metrics,
    merge_metric_parts,
    metric_records,
)

INF = float("inf")


def make_row(slp, adv, sample_index, topk_ids=None, topk_lps=None, num_samples=None) -> PackedRow:
    """A row holding only loss terms (the forward fields are dummies: losses never read them)."""
    n = len(slp)
    topk_ids = torch.zeros(n, 0, dtype=torch.long) if topk_ids is None else torch.as_tensor(topk_ids)
    topk_lps = torch.zeros(n, 0) if topk_lps is None else torch.as_tensor(topk_lps, dtype=torch.float32)
    sample_index = torch.as_tensor(sample_index, dtype=torch.long)
    return PackedRow(
        input_ids=torch.zeros(1, 1, dtype=torch.long),
        position_ids=torch.zeros(1, 1, dtype=torch.long),
        leave=torch.ones(1, dtype=torch.long),
        pred_index=torch.zeros(n, dtype=torch.long),
        target_ids=torch.zeros(n, dtype=torch.long),
        sampler_logprobs=torch.as_tensor(slp, dtype=torch.float32),
        advantages=torch.as_tensor(adv, dtype=torch.float32),
        sample_index=sample_index,
        num_forwarded=1,
        num_trained=n,
        num_samples=num_samples if num_samples is not None else int(sample_index.max()) + 1 if n else 0,
        num_unpacked=1,
        extras={SAMPLER_TOPK: TopK(topk_ids, topk_lps)},
    )


# ---------------------------------------------------------------- clipped, by hand

# (ratio, advantage) per token, and what min(rA, clip(r, 0.8, 1.2) A) picks with epsilon = 0.2.
CLIPPED_CASES = [
    (1.0, 2.0),  # inside the trust region: loss -2, d/dlogp = -A r = -2
    (1.5, 1.0),  # above 1 + eps, A > 0: clipped to 1.2 -> loss -1.2, no gradient
    (1.5, -1.0),  # above, A < 0: unclipped branch -1.5 -> loss 1.5, gradient 1.5
    (0.6, -1.0),  # below 1 - eps, A < 0: clipped -0.8 -> loss 0.8, no gradient
    (0.6, 1.0),  # below, A > 0: unclipped 0.6 -> loss -0.6, gradient -0.6
    (0.3, 1.0),  # ratio < clip_min 0.5: IS-masked
    (6.0, -1.0),  # ratio > clip_max 5.0: IS-masked
    (1.25, 1.0),  # clipped at 1.2 with epsilon_high unset; inside with epsilon_high = 0.28
]


def clipped_inputs():
    ratios = torch.tensor([r for r, _ in CLIPPED_CASES])
    slp = torch.full((len(CLIPPED_CASES),), -1.3)
    logp = (ratios.log() + slp).requires_grad_(True)
    adv = [a for _, a in CLIPPED_CASES]
    row = make_row(
        slp, adv, sample_index=[0, 0, 0, 0, 1, 1, 1, 1], num_samples=3
    )  # sample 2: no trained token
    entropy = torch.arange(len(CLIPPED_CASES), dtype=torch.float32)
    return logp, row, entropy


@pytest.mark.parametrize(
    ("eps_high", "loss_sum", "grad"),
    [
        (None, -2.7, [-2.0, 0, 1.5, 0, -0.6, 0, 0, 0]),
        (0.28, -2.83, [-2.0, 0, 1.5, 0, -0.6, 0, 0, -1.25]),  # token 1 now clipped at 1.28
    ],
)
def test_clipped_by_hand(eps_high, loss_sum, grad):
    logp, row, entropy = clipped_inputs()
    loss_fn = ClippedLoss(LossConfig(name="clipped", epsilon=0.2, epsilon_high=eps_high))
    loss, raw = loss_fn(TokenStats(logprobs=logp, entropy=entropy), row, num_trained_step=10)
    assert loss.item() == pytest.approx(loss_sum / 10, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(grad) / 10)
    m = finalize_metrics(raw)
    ratios = [r for r, _ in CLIPPED_CASES]
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.3)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(6.0)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(ratios) / 8)
    assert m["sampling/masked_mean"] == pytest.approx(2 / 8)
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(
        sum(abs(math.log(r)) for r in ratios) / 8
    )
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(6.0))
    assert m["entropy"] == pytest.approx(sum(range(8)) / 8)
    # low: r < 0.8 and A < 0 -> token 3; high: r > 1 + eps_high and A > 0 -> tokens 1 and (eps 0.2 only) 7.
    n_high = 2 if eps_high is None else 1
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 8)
    assert m["clip_ratio/high_mean"] == pytest.approx(n_high / 8)
    assert m["clip_ratio/region_mean"] == pytest.approx((1 + n_high) / 8)
    assert m["clip_ratio/low_min"] == 0.0  # sample 1 has none; sample 2 (no tokens) is not counted
    assert m["clip_ratio/high_max"] == pytest.approx(1 / 4)
    assert "sampling/sampler_mass" not in m


# ---------------------------------------------------------------- score centering, by hand


def test_score_centering_by_hand():
    # token 0: A = 1, r = 1.1 (kept); top-k: pi/mu = 0.5/0.4 (kept), 0.3/0.05 (r = 6, masked), padding.
    # token 1: A = -2, r = 0.3 (masked); top-k: 0.2/0.3 (r 0.67, kept), 0.1/0.1 (kept), 0.05/0.2 (r 0.25, masked).
    slp = torch.tensor([-1.0, -2.0])
    logp = torch.tensor([math.log(1.1) - 1.0, math.log(0.3) - 2.0], requires_grad=True)
    pi = torch.tensor([[0.5, 0.3, 0.0], [0.2, 0.1, 0.05]])
    mu = torch.tensor([[0.4, 0.05, 0.0], [0.3, 0.1, 0.2]])
    topk_logp = pi.log().requires_grad_(True)
    row = make_row(slp, [1.0, -2.0], [0, 1], topk_ids=[[3, 4, -1], [5, 6, 7]], topk_lps=mu.log())
    stats = TokenStats(logprobs=logp, entropy=torch.tensor([0.5, 1.5]), topk_logprobs=topk_logp)
    loss, raw = ScoreCenteringLoss(LossConfig())(stats, row, num_trained_step=4)
    # loss_t = -A (m_t r_t - Σ m_v pi_v):  t0 = -(1.1 - 0.5) = -0.6;  t1 = 2 (0 - 0.3) = -0.6
    assert loss.item() == pytest.approx(-1.2 / 4, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-1.1, 0.0]) / 4)  # -A m_t r_t
    torch.testing.assert_close(topk_logp.grad, torch.tensor([[0.5, 0, 0], [-0.4, -0.2, 0]]) / 4)  # A m_v pi_v
    m = finalize_metrics(raw)
    assert m["sampling/sampler_mass"] == pytest.approx((0.45 + 0.6) / 2)
    assert m["sampling/masked_mean"] == pytest.approx(0.5)
    assert m["clip_ratio/low_mean"] == pytest.approx(0.5)  # r = 0.3 < 0.8, whatever the advantage
    assert m["clip_ratio/high_mean"] == 0.0 and m["clip_ratio/high_max"] == 0.0
    assert m["clip_ratio/low_min"] == 0.0  # per sample: [0, 1]


def test_score_centering_needs_topk():
    row = make_row([-1.0], [1.0], [0])
    stats = TokenStats(logprobs=torch.tensor([-1.0]), entropy=torch.tensor([0.0]))
    with pytest.raises(ValueError, match="with_topk=True"):
        ScoreCenteringLoss(LossConfig())(stats, row, 1)


# ---------------------------------------------------------------- score centering on a toy softmax


def toy_problem(n: int, vocab: int, k: int, temperature: float, seed: int = 0):
    """Trainer logits z (parameter), a sampler that differs from it, sampled targets, the sampler's top-k."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g, requires_grad=True)
    sampler_logits = z.detach() / temperature + 0.8 * torch.randn(n, vocab, generator=g)
    mu = torch.softmax(sampler_logits, -1)
    targets = torch.multinomial(mu, 1, generator=g).squeeze(-1)
    topk_ids = mu.topk(k, dim=-1).indices
    adv = torch.randn(n, generator=g)
    row = make_row(
        mu.gather(-1, targets[:, None]).squeeze(-1).log(),
        adv,
        torch.arange(n) // 4,
        topk_ids=topk_ids,
        topk_lps=mu.gather(-1, topk_ids).log(),
    )
    return z, targets, row, mu


def toy_stats(z: torch.Tensor, targets: torch.Tensor, row: PackedRow, temperature: float) -> TokenStats:
    """What the log-prob head returns, computed on full toy logits (top-k padding -1 -> -inf)."""
    logp = torch.log_softmax(z / temperature, dim=-1)
    topk = logp.gather(-1, row.extras[SAMPLER_TOPK].ids.clamp(min=0)).masked_fill(
        row.extras[SAMPLER_TOPK].ids < 0, float("-inf")
    )
    return TokenStats(
        logprobs=logp.gather(-1, targets[:, None]).squeeze(-1),
        entropy=torch.zeros(len(targets)),
        topk_logprobs=topk,
    )


def test_score_centering_gradient_equals_analytic():
    n, vocab, k, temp = 24, 11, 4, 0.8
    z, targets, row, mu = toy_problem(n, vocab, k, temp)
    loss, _ = ScoreCenteringLoss(LossConfig())(toy_stats(z, targets, row, temp), row, num_trained_step=n)
    loss.backward()

    pi = torch.softmax(z.detach() / temp, -1)
    eye = torch.eye(vocab)
    grad_logpi = (eye[None, :, :] - pi[:, None, :]) / temp  # [n, v, V]: d log pi(v) / d z
    r_t = pi.gather(-1, targets[:, None]).squeeze(-1) / mu.gather(-1, targets[:, None]).squeeze(-1)
    m_t = ((r_t >= 0.5) & (r_t <= 5.0)).float()
    pi_v, mu_v = pi.gather(-1, row.extras[SAMPLER_TOPK].ids), mu.gather(-1, row.extras[SAMPLER_TOPK].ids)
    m_v = ((pi_v / mu_v >= 0.5) & (pi_v / mu_v <= 5.0)).float()
    own = (m_t * r_t)[:, None] * grad_logpi[torch.arange(n), targets]
    centering = (
        (m_v * pi_v)[:, :, None]
        * grad_logpi.gather(1, row.extras[SAMPLER_TOPK].ids[:, :, None].expand(-1, -1, vocab))
    ).sum(1)
    expected = -row.advantages[:, None] * (own - centering) / n
    assert 0 < m_t.sum() < n and 0 < m_v.sum() < m_v.numel(), "the toy should exercise both IS masks"
    torch.testing.assert_close(z.grad, expected, atol=1e-6, rtol=1e-5)


def test_score_centering_is_centered():
    """Top-k = the full vocabulary: E_{o~mu}[gradient] = 0 at a position, even with IS-masked tokens.

    Without masking E_mu[r grad log pi] = E_pi[grad log pi] = 0 anyway; masking breaks that (a biased pull),
    and the centering term removes it. Advantages = mu(o) weight each possible sampled token o by its probability.
    """
    vocab, temp = 6, 1.0
    z = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(vocab, vocab).clone().requires_grad_(True)
    mu = torch.softmax(torch.tensor([0.5, 1.0, 0.5, 1.5, 0.0, 0.0]), -1)
    pi = torch.softmax(z.detach()[0] / temp, -1)
    r = pi / mu
    assert ((r < 0.5) | (r > 5.0)).any() and ((r >= 0.5) & (r <= 5.0)).any()
    targets = torch.arange(vocab)

    def summed_grad(topk_ids: torch.Tensor) -> torch.Tensor:
        lps = mu.log()[topk_ids.clamp(min=0)].masked_fill(topk_ids < 0, float("-inf"))
        row = make_row(mu.log(), mu, [0] * vocab, topk_ids=topk_ids, topk_lps=lps)
        loss, _ = ScoreCenteringLoss(LossConfig())(toy_stats(z, targets, row, temp), row, num_trained_step=1)
        (grad,) = torch.autograd.grad(loss, z)
        return grad.sum(0)

    centered = summed_grad(mu.argsort(descending=True).expand(vocab, vocab))
    uncentered = summed_grad(torch.full((vocab, vocab), -1))
    torch.testing.assert_close(centered, torch.zeros(vocab), atol=1e-6, rtol=0)
    assert uncentered.abs().max() > 1e-2


# ---------------------------------------------------------------- exact accumulation


def concat_rows(rows: list[PackedRow]) -> PackedRow:
    offsets = [0]
    for r in rows[:-1]:
        offsets.append(offsets[-1] + r.num_samples)
    k = max(r.extras[SAMPLER_TOPK].width for r in rows)
    return make_row(
        torch.cat([r.sampler_logprobs for r in rows]),
        torch.cat([r.advantages for r in rows]),
        torch.cat([r.sample_index + o for r, o in zip(rows, offsets, strict=True)]),
        topk_ids=torch.cat([r.extras[SAMPLER_TOPK].ids for r in rows]) if k else None,
        topk_lps=torch.cat([r.extras[SAMPLER_TOPK].logprobs for r in rows]) if k else None,
        num_samples=sum(r.num_samples for r in rows),
    )


@pytest.mark.parametrize("loss_cls", [ClippedLoss, ScoreCenteringLoss])
@pytest.mark.parametrize("counts", [(100, 900), (100, 100), (0, 9), (0, 0)])
def test_accumulation_equals_full_batch(loss_cls, counts):
    vocab, temp = 13, 0.9
    loss_fn = loss_cls(LossConfig())
    torch.manual_seed(0)
    w = torch.randn(8, vocab, requires_grad=True)
    micro = []
    for i, n in enumerate(counts):
        _, targets, row, _ = toy_problem(n, vocab, 3, temp, seed=i)
        micro.append((torch.randn(n, 8), targets, row))
    total = sum(counts)

    acc_loss = 0.0
    for x, targets, row in micro:
        loss, _ = loss_fn(toy_stats(x @ w, targets, row, temp), row, num_trained_step=total)
        assert loss.requires_grad
        loss.backward()
        acc_loss += loss.item()
    acc_grad, w.grad = w.grad.clone(), None

    full = concat_rows([row for _, _, row in micro])
    x_all, t_all = torch.cat([x for x, _, _ in micro]), torch.cat([t for _, t, _ in micro])
    loss, _ = loss_fn(toy_stats(x_all @ w, t_all, full, temp), full, num_trained_step=total)
    loss.backward()
    assert acc_loss == pytest.approx(loss.item(), abs=1e-5)
    torch.testing.assert_close(acc_grad, w.grad, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(acc_grad).all()
    if total == 0:
        assert (acc_grad == 0).all() and acc_loss == 0.0


# ---------------------------------------------------------------- metric reduction


@pytest.mark.parametrize("loss_cls", [ClippedLoss, ScoreCenteringLoss])
def test_metrics_merge_equals_one_call(loss_cls):
    loss_fn, temp = loss_cls(LossConfig(epsilon=0.1)), 1.0
    parts, rows, stats = [], [], []
    for seed, n in enumerate([12, 0, 20]):
        z, targets, row, _ = toy_problem(n, 9, 3, temp, seed=seed)
        s = toy_stats(z * 3, targets, row, temp)  # sharper trainer: ratios spread, some clipped and masked
        s.entropy = torch.rand(n)
        parts.append(loss_fn(s, row, 32)[1])
        rows.append(row)
        stats.append(s)
    merged = finalize_metrics(merge_metric_parts(parts))
    full_row = concat_rows(rows)
    full_stats = TokenStats(
        logprobs=torch.cat([s.logprobs for s in stats]),
        entropy=torch.cat([s.entropy for s in stats]),
        topk_logprobs=torch.cat([s.topk_logprobs for s in stats]),
    )
    single = finalize_metrics(loss_fn(full_stats, full_row, 32)[1])
    assert merged.keys() == single.keys()
    assert ("sampling/sampler_mass" in merged) == (loss_cls is ScoreCenteringLoss)
    for key, value in single.items():
        assert merged[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert 0 < single["sampling/masked_mean"] < 1 and single["clip_ratio/region_mean"] > 0
    assert finalize_metrics(parts[1]) == {}  # a zero-token micro-batch alone reports nothing
    assert metric_records(parts[1]) == ({}, {})
    rates, extremes = metric_records(merge_metric_parts(parts))
    assert {den for _, den in rates.values()} == {32.0}  # every mean is a (sum, trained tokens) pair
    assert all(merged[name] == pytest.approx(num / den) for name, (num, den) in rates.items())
    assert set(extremes) == {k for k in merged if k.endswith(("min", "max"))}


def test_registered_and_topk_flags():
    assert resolve("loss", "clipped") is ClippedLoss and ClippedLoss.needs == ()
    assert resolve("loss", "score_centering") is ScoreCenteringLoss and ScoreCenteringLoss.needs == (
        SAMPLER_TOPK,
    )
