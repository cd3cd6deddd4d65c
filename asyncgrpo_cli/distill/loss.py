"""Generalized Jensen-Shannon divergence between the student and a teacher's sparse top-k (``asyncgrpo distill``).

Per trained token, with the teacher's reported candidates C (``TeacherTopK``: its top-K by rank, column 0 the
top-1, plus the realized token when it is outside the top-K), the student's log-probs log p_S(v) (the trainer's
head at temperature τ = ``loss.teacher_temperature``, normalized over the full vocabulary) and the teacher's
tempered log-probs log p_T(v) (below), β = ``loss.beta``:

    support S:   β = 0       every valid candidate of C (the top-K and the realized token)
                 0 < β < 1   the teacher's top-1 and the realized token (one element when they are the same)
                 β = 1       the realized token only
    tail ∅:      log p(∅) = log(1 − exp(min(logsumexp_{v∈S} log p(v), −1e-7))), on each side, one more outcome
                 (``loss.add_tail_bucket``); without it both sides are renormalized over S instead
    jsd_t = Σ_{v ∈ S ∪ {∅}} ℓ(v)
        β = 0:   ℓ = p_T (log p_T − log p_S)                                    KL(T ‖ S), forward
        β = 1:   ℓ = p_S (log p_S − log p_T)                                    KL(S ‖ T), reverse
        else:    ℓ = β p_T (log p_T − log M) + (1 − β) p_S (log p_S − log M),  M = β p_T + (1 − β) p_S
    loss = Σ_t jsd_t / max(num_trained_step, 1)

β > 0 narrows the support to the two tokens the wire protocol guarantees a teacher log-prob for (reference 6.1,
appendix A.2). A token with no valid candidate (a row of -1, e.g. a sample without teacher scores) or, for β > 0,
whose realized token is not in its list contributes 0 (counted in ``masked_sum``); 0·∞ terms at padding are 0.
Gradients flow only through the student's log-probs of the candidate ids (``stats.topk_logprobs``); the tail's
log-sum is clamped, so a support that holds (almost) all of the student's mass gets no gradient through its tail.

Teacher temperature. Servers report prompt log-probs before their sampler, so t_v are raw T = 1 log-probs and τ
is applied here. τ = 1 uses them unchanged (exact). Otherwise, over the reported candidates C:

    log p_T(v) = t_v / τ − log(Σ_{c∈C} exp(t_c / τ) + R),   R = m · p_min^(1/τ − 1)
    m = max(0, 1 − Σ_{c∈C} exp(t_c))            the teacher's mass outside C
    p_min = min of the reported top-K probabilities (all of C when no top-K column is valid)

R estimates Σ_{u∉C} p_u^(1/τ) with a flat tail at p_min, the largest probability a token outside the top-K can have:
an upper bound of the true tempered tail for τ < 1 (sharpening), a lower bound for τ > 1. The student side is
exact at every τ (the head divides its full-vocabulary logits by τ: ``head_temperature``).

Normalization as ``train/losses.py``: ``num_trained_step`` counts the trained tokens of the whole optimizer step,
masked ones included, so accumulated micro-batches sum to the full-batch token mean.

Raw metrics (0-d detached tensors, summed over micro-batches and ranks, ``*_max`` by max): ``token_count`` (trained
tokens), ``jsd_sum``, ``jsd_max``, ``entropy_sum`` (the student's full-vocabulary entropy), ``teacher_entropy_sum``
(the tempered teacher over all of C plus its tail bucket: a lower bound of its entropy), ``masked_sum``, and per
teacher name n (every name of ``teacher_names``, zeros when absent) ``teacher/{n}/jsd_sum``,
``teacher/{n}/entropy_sum`` (teacher entropy) and ``teacher/{n}/token_count`` (tokens routed to n).
"""

from __future__ import annotations

import math

import torch

from asyncgrpo_cli.config.schema import LossConfig
from asyncgrpo_cli.model.logprobs import TokenStats
from asyncgrpo_cli.packing.row import PackedRow
from asyncgrpo_cli.samples import TEACHER_TOPK

TAIL_LOG_SUM_MAX = -1e-7
"""Upper clamp of a support's log-sum before log(1 − exp(·)), so the tail bucket stays finite."""
NEG_INF = float("-inf")


class JSDLoss:
    """Generalized JSD against the teacher's sparse distribution (module doc); a ``protocols.Loss``."""

    needs: tuple[str, ...] = (TEACHER_TOPK,)

    def __init__(self, cfg: LossConfig) -> None:
        if not 0.0 <= cfg.beta <= 1.0:
            raise ValueError(
                f"loss.beta ({cfg.beta}) must be in [0, 1]: 0 forward KL (the default), 1 reverse KL, in between "
                "the generalized JSD; set loss.beta in that range"
            )
        if not cfg.teacher_temperature > 0:
            raise ValueError(
                f"loss.teacher_temperature ({cfg.teacher_temperature}) must be positive: set it > 0 (1.0 uses the "
                "teacher's log-probs as reported)"
            )
        self.beta = float(cfg.beta)
        self.add_tail_bucket = bool(cfg.add_tail_bucket)
        self.head_temperature: float | None = float(cfg.teacher_temperature)

    def __call__(self, stats: TokenStats, row: PackedRow, num_trained_step: int) -> tuple[torch.Tensor, dict]:
        if row.support_ids is not None:
            raise ValueError(
                "loss.name=jsd compares full-vocabulary distributions, but the row carries sampling candidate sets "
                "(the head would renormalize the student over them): set sampling.sampling_mask=off"
            )
        teacher = row.extras.get(TEACHER_TOPK)
        if teacher is None:  # a context-only filler row: nothing to distill, still in the graph
            n = row.target_ids.shape[0]
            zeros = torch.zeros(n, device=stats.logprobs.device)
            metrics = _metrics(stats, zeros, zeros, zeros.bool(), None)
            return stats.logprobs.sum() * 0.0, metrics
        if stats.topk_logprobs is None:
            raise ValueError(
                "loss.name=jsd needs the student's log-probs of the teacher's candidates: call "
                "token_logprobs(with_topk=True) (the trainer does when loss.needs is non-empty)"
            )
        student = stats.topk_logprobs[:, row.candidate_columns(TEACHER_TOPK)].float()
        teacher_lp = temper_teacher(teacher.ids, teacher.logprobs, self.head_temperature)
        support, active = support_mask(teacher.ids, row.target_ids, self.beta)
        jsd = token_jsd(student, teacher_lp, support, active, self.beta, self.add_tail_bucket)
        loss = jsd.sum() / max(num_trained_step, 1)
        with torch.no_grad():
            teacher_h = teacher_entropy(teacher.ids, teacher_lp)
        return loss, _metrics(stats, jsd.detach(), teacher_h, active, teacher)

    def metric_records(
        self, raw: dict[str, torch.Tensor]
    ) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
        return metric_records(raw)


# ------------------------------------------------------------------------------------------------- the math
def temper_teacher(ids: torch.Tensor, logprobs: torch.Tensor, temperature: float) -> torch.Tensor:
    """Teacher log-probs at ``temperature`` over the reported candidates (module doc), float32 [N, K+1], -inf at
    padding (id -1). Column K (the last) is the realized token outside the top-K; columns 0..K-1 give p_min."""
    valid = ids >= 0
    raw = torch.where(valid, logprobs.float(), NEG_INF)
    if temperature == 1.0 or ids.shape[1] == 0:
        return raw
    t = raw.double()
    reported = valid.any(1)
    top = valid[:, :-1]
    all_min = torch.where(valid, t, math.inf).amin(1)  # used where no top-K column is valid
    top_min = torch.where(top, t[:, :-1], math.inf).amin(1) if top.shape[1] else all_min
    log_p_min = torch.where(top.any(1), top_min, all_min)
    mass = (-torch.expm1(torch.logsumexp(t, dim=1))).clamp(min=0.0)  # m
    has_tail = reported & (mass > 0)
    log_r = torch.where(has_tail, mass.log() + (1.0 / temperature - 1.0) * log_p_min, NEG_INF)
    scaled = t / temperature
    log_z = torch.logaddexp(torch.logsumexp(scaled, dim=1), log_r)
    out = torch.where(valid, scaled - torch.where(reported, log_z, 0.0)[:, None], NEG_INF)
    return out.float()


def support_mask(ids: torch.Tensor, targets: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(support bool [N, K+1], active bool [N]): the candidate columns each token's divergence runs over, and the
    tokens that have any (module doc). The realized token is the first column whose id equals the target."""
    valid = ids >= 0
    if beta == 0.0:
        support = valid
    else:
        realized = valid & (ids == targets[:, None])
        support = realized & (realized.cumsum(1) == 1)
        if beta < 1.0 and ids.shape[1]:
            support[:, 0] |= valid[:, 0] & realized.any(1)
    return support, support.any(1)


def _with_tail(logp: torch.Tensor, tail: bool) -> torch.Tensor:
    """The support's log-probs plus the tail bucket column, or renormalized over the support. ``logp`` is -inf off
    the support and finite on it (inactive rows: constants)."""
    log_sum = torch.logsumexp(logp, dim=1)
    if not tail:
        return logp - log_sum[:, None]
    log_tail = torch.log(-torch.expm1(log_sum.clamp(max=TAIL_LOG_SUM_MAX)))
    return torch.cat([logp, log_tail[:, None]], dim=1)


def token_jsd(
    student: torch.Tensor,
    teacher: torch.Tensor,
    support: torch.Tensor,
    active: torch.Tensor,
    beta: float,
    tail: bool,
) -> torch.Tensor:
    """jsd_t [N] (module doc) from the student's and the teacher's log-probs of the candidates [N, K+1]; 0 on
    inactive tokens. Off-support entries are replaced by constants before the divergence, so no NaN or ∞ reaches
    the gradient of a live entry."""
    rows = active[:, None]
    s = torch.where(rows, torch.where(support, student, NEG_INF), 0.0)  # inactive rows: finite constants
    t = torch.where(rows, torch.where(support, teacher, NEG_INF), 0.0)
    log_s, log_t = _with_tail(s, tail), _with_tail(t, tail)
    live = torch.cat([support, active[:, None]], dim=1) if tail else support
    live = live & rows
    log_s, log_t = torch.where(live, log_s, 0.0), torch.where(live, log_t, 0.0)
    p_s, p_t = log_s.exp(), log_t.exp()
    if beta == 0.0:
        term = p_t * (log_t - log_s)
    elif beta == 1.0:
        term = p_s * (log_s - log_t)
    else:
        log_m = torch.logaddexp(log_s + math.log(1.0 - beta), log_t + math.log(beta))
        term = beta * p_t * (log_t - log_m) + (1.0 - beta) * p_s * (log_s - log_m)
    term = torch.where(live & ~torch.isnan(term), term, 0.0)
    return term.sum(1)


def teacher_entropy(ids: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """−Σ_{v∈C} p_T log p_T − p(∅) log p(∅) [N]: the tempered teacher over every reported candidate plus its tail
    bucket, a lower bound of its entropy (0 where nothing was reported)."""
    valid = ids >= 0
    t = teacher.double()
    inside = -torch.where(valid, t.exp() * t, 0.0).sum(1)
    log_tail = torch.log(-torch.expm1(torch.logsumexp(t, dim=1).clamp(max=TAIL_LOG_SUM_MAX)))
    return (inside - log_tail.exp() * log_tail).float()


# ------------------------------------------------------------------------------------------------- metrics
def _metrics(
    stats: TokenStats,
    jsd: torch.Tensor,
    teacher_h: torch.Tensor,
    active: torch.Tensor,
    teacher,
) -> dict[str, torch.Tensor]:
    device = jsd.device
    out = {
        "token_count": torch.full((), float(jsd.numel()), device=device),  # no host copy
        "jsd_sum": jsd.sum(),
        "jsd_max": jsd.max() if jsd.numel() else torch.full((), NEG_INF, device=device),
        "entropy_sum": stats.entropy.detach().float().sum(),
        "teacher_entropy_sum": teacher_h.sum(),
        "masked_sum": (~active).float().sum().to(device),
    }
    for i, name in enumerate(() if teacher is None else teacher.teacher_names):
        mine = (teacher.teacher == i).to(device)
        out[f"teacher/{name}/jsd_sum"] = torch.where(mine, jsd, 0.0).sum()
        out[f"teacher/{name}/entropy_sum"] = torch.where(mine, teacher_h, 0.0).sum()
        out[f"teacher/{name}/token_count"] = mine.float().sum()
    return out


def _teacher_names(raw: dict[str, torch.Tensor]) -> list[str]:
    suffix = "/token_count"
    return sorted(
        k[len("teacher/") : -len(suffix)] for k in raw if k.startswith("teacher/") and k.endswith(suffix)
    )


def metric_records(
    raw: dict[str, torch.Tensor],
) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """Merged raw material as window records: token means as (sum, tokens) pairs, and the largest token JSD.

    ``jsd``, ``entropy``, ``teacher_entropy`` and ``jsd_masked_frac`` over the trained tokens; per teacher n
    ``teacher_jsd/{n}`` and ``teacher_entropy/{n}`` over its tokens, ``teacher_token_frac/{n}`` its share of the
    trained tokens. A rate with no token behind it is left out.
    """
    count = float(raw["token_count"])
    rates: dict[str, tuple[float, float]] = {}
    if count > 0:
        for name, key in (
            ("jsd", "jsd_sum"),
            ("entropy", "entropy_sum"),
            ("teacher_entropy", "teacher_entropy_sum"),
            ("jsd_masked_frac", "masked_sum"),
        ):
            rates[name] = (float(raw[key]), count)
    for name in _teacher_names(raw):
        mine = float(raw[f"teacher/{name}/token_count"])
        if mine > 0:
            rates[f"teacher_jsd/{name}"] = (float(raw[f"teacher/{name}/jsd_sum"]), mine)
            rates[f"teacher_entropy/{name}"] = (float(raw[f"teacher/{name}/entropy_sum"]), mine)
        if count > 0:
            rates[f"teacher_token_frac/{name}"] = (mine, count)
    jsd_max = float(raw["jsd_max"])
    return rates, ({"jsd_max": jsd_max} if math.isfinite(jsd_max) else {})
