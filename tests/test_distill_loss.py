"""The JSD distillation loss against float64 formulas written out per position over hand-built full distributions:
supports per beta, tail bucket, padding, masking, teacher tempering, exact accumulation, per-teacher metrics, and
the whole path through the chunked head of a tiny Qwen3 against per-sample full logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.schema import LossConfig, PackingConfig
from asyncgrpo_cli.distill.loss import JSDLoss, temper_teacher
from asyncgrpo_cli.model.logprobs import TokenStats, token_logprobs
from asyncgrpo_cli.packing.row import PackedRow
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.registry import resolve
from asyncgrpo_cli.samples import TEACHER_TOPK, TeacherTopK, TrainingSequence
from asyncgrpo_cli.train.losses import merge_metric_parts

NEG_INF = float("-inf")
V, K = 10, 3


# ------------------------------------------------------------------------------------------------ references
def ref_temper(ids: list[int], lps: list[float], tau: float) -> list[float]:
    """The module's tempering estimate, position by position in float64: a flat tail at the smallest top-K p."""
    if tau == 1.0:
        return [lp if i >= 0 else NEG_INF for i, lp in zip(ids, lps, strict=True)]
    probs = {c: math.exp(lp) for c, (i, lp) in enumerate(zip(ids, lps, strict=True)) if i >= 0}
    if not probs:
        return [NEG_INF] * len(ids)
    top = [p for c, p in probs.items() if c < len(ids) - 1] or list(probs.values())
    rest = max(0.0, 1.0 - sum(probs.values()))
    z = sum(p ** (1 / tau) for p in probs.values()) + rest * min(top) ** (1 / tau - 1)
    return [math.log(probs[c] ** (1 / tau) / z) if c in probs else NEG_INF for c in range(len(ids))]


def ref_jsd(student_row, ids, teacher_lps, target, beta, tail):
    """jsd of one position from the student's full log-probs [V] (float64 torch, may carry grad) and the teacher's
    reported (id, log-prob) pairs, with the support picked by hand."""
    reported = {i: lp for i, lp in zip(ids, teacher_lps, strict=True) if i >= 0}
    if not reported or (beta > 0 and target not in reported):
        return student_row.sum() * 0.0
    if beta == 0:
        support = list(reported)
    elif beta == 1:
        support = [target]
    else:
        support = list(dict.fromkeys([ids[0], target]))
    p_s = torch.stack([student_row[v].exp() for v in support])
    p_t = torch.tensor([math.exp(reported[v]) for v in support], dtype=torch.float64)
    if tail:
        p_s = torch.cat([p_s, (1 - p_s.sum())[None]])
        p_t = torch.cat([p_t, (1 - p_t.sum())[None]])
    else:
        p_s, p_t = p_s / p_s.sum(), p_t / p_t.sum()
    if beta == 0:
        return (p_t * (p_t / p_s).log()).sum()
    if beta == 1:
        return (p_s * (p_s / p_t).log()).sum()
    m = beta * p_t + (1 - beta) * p_s
    return beta * (p_t * (p_t / m).log()).sum() + (1 - beta) * (p_s * (p_s / m).log()).sum()


def ref_teacher_entropy(ids, teacher_lps) -> float:
    probs = [math.exp(lp) for i, lp in zip(ids, teacher_lps, strict=True) if i >= 0]
    if not probs:
        return 0.0
    tail = 1 - sum(probs)
    return -sum(p * math.log(p) for p in probs) - tail * math.log(tail)


# ------------------------------------------------------------------------------------------------ hand-made rows
def teacher_case():
    """Per position: a full teacher distribution over V, its reported top-K + realized column, and the target.

    0: target inside the top-K (rank 2)       1: target = the teacher's top-1     2: target outside the top-K
    3: the teacher reported only 2 of K=3     4: no candidate at all              5: target outside, not reported
    """
    gen = torch.Generator().manual_seed(0)
    teacher_full = torch.log_softmax(torch.randn(6, V, generator=gen, dtype=torch.float64) * 1.5, -1)
    order = teacher_full.argsort(-1, descending=True)
    ids = torch.full((6, K + 1), -1, dtype=torch.long)
    targets = torch.empty(6, dtype=torch.long)
    for p in range(6):
        ids[p, :K] = order[p, :K]
    targets[0], targets[1], targets[2] = order[0, 1], order[1, 0], order[2, 6]
    ids[2, K] = targets[2]
    ids[3, 2] = -1
    targets[3] = order[3, 1]
    ids[4] = -1
    targets[4] = 3
    targets[5] = order[5, 7]
    lps = torch.where(ids >= 0, teacher_full.gather(1, ids.clamp(min=0)), NEG_INF).float()
    return ids, lps, targets


def make_row(ids, lps, targets, teacher=None, names=("default",)) -> PackedRow:
    """A row holding only loss terms (forward fields are dummies: losses never read them)."""
    n = len(targets)
    teacher = torch.zeros(n, dtype=torch.long) if teacher is None else torch.as_tensor(teacher)
    return PackedRow(
        input_ids=torch.zeros(1, 1, dtype=torch.long),
        position_ids=torch.zeros(1, 1, dtype=torch.long),
        leave=torch.ones(1, dtype=torch.long),
        pred_index=torch.zeros(n, dtype=torch.long),
        target_ids=targets,
        sampler_logprobs=torch.zeros(n),
        advantages=torch.zeros(n),
        sample_index=torch.zeros(n, dtype=torch.long),
        num_forwarded=1,
        num_trained=n,
        num_samples=1,
        num_unpacked=1,
        extras={TEACHER_TOPK: TeacherTopK(ids, lps, teacher=teacher, teacher_names=names)},
    )


def student_stats(logits: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor) -> TokenStats:
    logp = torch.log_softmax(logits, -1)
    cand = logp.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, NEG_INF)
    entropy = -(logp.exp() * logp).sum(-1).detach()
    return TokenStats(logp.gather(1, targets[:, None]).squeeze(1), entropy, cand)


def jsd_loss(beta=0.0, tail=True, tau=1.0) -> JSDLoss:
    return JSDLoss(LossConfig(name="jsd", beta=beta, add_tail_bucket=tail, teacher_temperature=tau))


def student_logits(n: int = 6, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=gen, dtype=torch.float64).requires_grad_(True)


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "renormalized"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_matches_formulas(beta, tail):
    ids, lps, targets = teacher_case()
    logits = student_logits()
    loss, raw = jsd_loss(beta, tail)(student_stats(logits, ids, targets), make_row(ids, lps, targets), 10)
    loss.backward()
    got_grad, logits.grad = logits.grad.clone(), None

    logp = torch.log_softmax(logits, -1)
    per_pos = [
        ref_jsd(logp[p], ids[p].tolist(), lps[p].double().tolist(), int(targets[p]), beta, tail)
        for p in range(6)
    ]
    ref = torch.stack(per_pos).sum() / 10
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, logits.grad, rtol=1e-4, atol=1e-6)
    masked = {0.0: 1, 0.5: 2, 1.0: 2}[beta]  # position 4; for beta > 0 also 5 (realized not reported)
    assert float(raw["masked_sum"]) == masked and float(raw["token_count"]) == 6
    values = [float(v.detach()) for v in per_pos]
    assert values[4] == 0.0 and (values[5] == 0.0) == (beta > 0)
    # a one-element support renormalized is the same point mass on both sides: nothing to learn there
    single = [beta == 1.0 or (beta > 0 and p == 1) for p in range(4)]
    assert [v > 0 for v in values[:4]] == [tail or not one for one in single]
    assert float(raw["jsd_sum"]) == pytest.approx(sum(values), rel=1e-5)
    assert float(raw["jsd_max"]) == pytest.approx(max(values), rel=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_support_rules(beta):
    """At position 0 (target at rank 2): rank 3 is in the support only at beta 0, the top-1 only below beta 1."""
    ids, lps, targets = teacher_case()
    logits = student_logits()
    loss_fn = jsd_loss(beta)
    base = float(loss_fn(student_stats(logits, ids, targets), make_row(ids, lps, targets), 6)[0].detach())

    def changed(column: int) -> bool:
        moved = lps.clone()
        moved[0, column] -= 0.3
        return (
            float(loss_fn(student_stats(logits, ids, targets), make_row(ids, moved, targets), 6)[0].detach())
            != base
        )

    assert changed(2) == (beta == 0.0)  # neither top-1 nor realized
    assert changed(0) == (beta < 1.0)  # the top-1
    assert changed(1)  # the realized token, always


def test_micro_batches_sum_to_one_row():
    ids, lps, targets = teacher_case()
    logits = student_logits()
    loss_fn = jsd_loss(0.5)
    whole, _ = loss_fn(student_stats(logits, ids, targets), make_row(ids, lps, targets), 6)
    whole.backward()
    ref_grad, logits.grad = logits.grad.clone(), None
    total = 0.0
    for part in (slice(0, 2), slice(2, 6)):
        stats = student_stats(logits[part], ids[part], targets[part])
        loss, _ = loss_fn(stats, make_row(ids[part], lps[part], targets[part]), 6)
        loss.backward()
        total += float(loss.detach())
    assert total == pytest.approx(float(whole.detach()), rel=1e-6)
    torch.testing.assert_close(logits.grad, ref_grad, rtol=1e-6, atol=1e-9)


def test_temperature_estimate():
    ids, lps, targets = teacher_case()
    one = temper_teacher(ids, lps, 1.0)
    assert torch.equal(one[ids >= 0], lps[ids >= 0]) and torch.isneginf(one[ids < 0]).all()
    for tau in (0.5, 2.0):
        got = temper_teacher(ids, lps, tau)
        for p in range(len(ids)):
            want = ref_temper(ids[p].tolist(), lps[p].double().tolist(), tau)
            assert got[p].tolist() == pytest.approx(want, rel=1e-5), (tau, p)
    # the student side follows the head: the loss asks for its full-vocabulary log-softmax at tau
    assert jsd_loss(tau=0.7).head_temperature == 0.7 and jsd_loss().needs == (TEACHER_TOPK,)


def test_tempered_loss_uses_the_tempered_teacher():
    ids, lps, targets = teacher_case()
    logits = student_logits()
    loss, _ = jsd_loss(0.0, tau=0.5)(student_stats(logits, ids, targets), make_row(ids, lps, targets), 6)
    logp = torch.log_softmax(logits, -1).detach()
    ref = sum(
        float(ref_jsd(logp[p], ids[p].tolist(), ref_temper(ids[p].tolist(), lps[p].double().tolist(), 0.5),
                      int(targets[p]), 0.0, True))
        for p in range(6)
    )  # fmt: skip
    assert float(loss.detach()) == pytest.approx(ref / 6, rel=1e-5)


def test_per_teacher_metrics_and_records():
    ids, lps, targets = teacher_case()
    logits = student_logits()
    teacher = [0, 0, 1, 1, -1, 1]  # position 4 came from a sample without teacher scores
    loss_fn = jsd_loss(0.0)
    row = make_row(ids, lps, targets, teacher=teacher, names=("code", "math"))
    stats = student_stats(logits, ids, targets)
    _, raw = loss_fn(stats, row, 6)
    logp = torch.log_softmax(logits, -1).detach()
    jsd = [float(ref_jsd(logp[p], ids[p].tolist(), lps[p].double().tolist(), int(targets[p]), 0.0, True))
           for p in range(6)]  # fmt: skip
    ent = [ref_teacher_entropy(ids[p].tolist(), lps[p].double().tolist()) for p in range(6)]
    for i, name in enumerate(("code", "math")):
        mine = [p for p in range(6) if teacher[p] == i]
        assert float(raw[f"teacher/{name}/token_count"]) == len(mine)
        assert float(raw[f"teacher/{name}/jsd_sum"]) == pytest.approx(sum(jsd[p] for p in mine), rel=1e-5)
        assert float(raw[f"teacher/{name}/entropy_sum"]) == pytest.approx(sum(ent[p] for p in mine), rel=1e-5)
    assert float(raw["teacher_entropy_sum"]) == pytest.approx(sum(ent), rel=1e-5)
    assert float(raw["entropy_sum"]) == pytest.approx(float(stats.entropy.sum()), rel=1e-6)
    assert all(v.ndim == 0 and not v.requires_grad for v in raw.values())

    # a second micro-batch with only "code" tokens: "math" is still named (zeros), so ranks agree
    part2 = make_row(ids[:2], lps[:2], targets[:2], teacher=[0, 0], names=("code", "math"))
    _, raw2 = loss_fn(student_stats(logits[:2], ids[:2], targets[:2]), part2, 8)
    assert float(raw2["teacher/math/token_count"]) == 0.0
    rates, extremes = loss_fn.metric_records(merge_metric_parts([raw, raw2]))
    assert rates["jsd"] == pytest.approx((sum(jsd) + jsd[0] + jsd[1], 8), rel=1e-5)
    assert rates["entropy"][1] == 8 and rates["teacher_entropy"][1] == 8
    assert rates["jsd_masked_frac"] == (1.0, 8)
    assert rates["teacher_jsd/code"] == pytest.approx((2 * (jsd[0] + jsd[1]), 4), rel=1e-5)
    assert rates["teacher_entropy/math"] == pytest.approx((ent[2] + ent[3] + ent[5], 3), rel=1e-5)
    assert rates["teacher_token_frac/code"] == (4.0, 8.0) and rates["teacher_token_frac/math"] == (3.0, 8.0)
    assert extremes == {"jsd_max": pytest.approx(max(jsd), rel=1e-5)}

    # a teacher with no token: its share is 0, its token means are left out; no token at all: nothing
    _, only_code = loss_fn(student_stats(logits[:2], ids[:2], targets[:2]), part2, 2)
    rates, _ = loss_fn.metric_records(only_code)
    assert rates["teacher_token_frac/math"] == (0.0, 2.0) and "teacher_jsd/math" not in rates
    empty = make_row(ids[:0], lps[:0], targets[:0], teacher=torch.zeros(0, dtype=torch.long))
    loss, raw0 = loss_fn(student_stats(logits[:0], ids[:0], targets[:0]), empty, 0)
    assert float(loss.detach()) == 0.0 and loss.requires_grad
    assert loss_fn.metric_records(raw0) == ({}, {})


def test_rows_without_teacher_scores():
    ids, lps, targets = teacher_case()
    logits = student_logits()
    stats = student_stats(logits, ids, targets)
    filler = make_row(ids, lps, targets)
    filler.extras = {}
    loss, raw = jsd_loss()(stats, filler, 6)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.count_nonzero(logits.grad) == 0
    assert float(raw["masked_sum"]) == 6 and float(raw["jsd_sum"]) == 0
    # an extra of width 0 (every sample of the row lacked scores): all masked, no NaN
    empty = TeacherTopK.empty(6)
    row = make_row(torch.from_numpy(empty.ids), torch.from_numpy(empty.logprobs), targets, names=())
    row.extras[TEACHER_TOPK].teacher = torch.from_numpy(empty.teacher)
    loss, raw = jsd_loss(0.5)(TokenStats(stats.logprobs, stats.entropy, stats.topk_logprobs[:, :0]), row, 6)
    assert (
        float(loss.detach()) == 0.0
        and float(raw["masked_sum"]) == 6
        and float(raw["teacher_entropy_sum"]) == 0
    )


def test_config_errors_and_registration():
    with pytest.raises(ValueError, match=r"loss\.beta \(1\.5\) must be in \[0, 1\]"):
        jsd_loss(beta=1.5)
    with pytest.raises(ValueError, match=r"loss\.teacher_temperature \(0\.0\) must be positive"):
        jsd_loss(tau=0.0)
    assert resolve("loss", "jsd") is JSDLoss
    ids, lps, targets = teacher_case()
    row = make_row(ids, lps, targets)
    row.support_ids = torch.full((6, 2), -1, dtype=torch.long)
    with pytest.raises(ValueError, match="sampling.sampling_mask=off"):
        jsd_loss()(student_stats(student_logits(), ids, targets), row, 6)


# ------------------------------------------------------------------------------------------------ the real head
@pytest.fixture(scope="module")
def qwen3(tiny_model_dir, one_torch_thread):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )


def scored_sample(rng, vocab: int, length: int, prompt: int, teacher: int, k: int = 4) -> TrainingSequence:
    """A sample whose trained tokens carry a random teacher's top-k (+ realized column); one has no candidate."""
    input_ids = rng.integers(0, vocab, size=length)
    mask = np.arange(length) >= prompt
    trained = np.flatnonzero(mask)
    logits = rng.normal(0, 2.0, size=(len(trained), vocab))
    top = logits.max(1, keepdims=True)
    full = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
    order = np.argsort(-full, axis=1)
    input_ids[trained[2]] = order[2, 1]  # this target is inside the top-K (rank 2); the others fall outside
    targets = input_ids[trained]
    ids = np.full((len(trained), k + 1), -1, dtype=np.int64)
    ids[:, :k] = order[:, :k]
    outside = (ids[:, :k] != targets[:, None]).all(1)
    ids[outside, k] = targets[outside]
    ids[1, :] = -1  # the teacher reported nothing here
    lps = np.where(ids >= 0, np.take_along_axis(full, np.maximum(ids, 0), 1), -np.inf).astype(np.float32)
    extra = TeacherTopK(ids, lps, teacher=np.full(len(trained), teacher), teacher_names=("code", "math"))
    return TrainingSequence(input_ids=input_ids, train_mask=mask, sampler_logprobs=np.zeros(length, np.float32),
                            token_extras={TEACHER_TOPK: extra})  # fmt: skip


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_through_the_chunked_head(qwen3, beta):
    tau = 0.7
    vocab = qwen3.config.vocab_size
    rng = np.random.default_rng(3)
    samples = [scored_sample(rng, vocab, 9, 3, teacher=0), scored_sample(rng, vocab, 7, 2, teacher=1)]
    num_trained = sum(int(s.train_mask.sum()) for s in samples)
    loss_fn = jsd_loss(beta, tau=tau)
    qwen3.train()
    row = SequencePacker(PackingConfig()).pack(samples)
    stats = token_logprobs(qwen3, row, loss_fn.head_temperature, with_topk=True)
    loss, raw = loss_fn(stats, row, num_trained)
    loss.backward()
    got = grads(qwen3)

    ref = []
    for s in samples:
        logits = qwen3(input_ids=torch.from_numpy(s.input_ids)[None], use_cache=False).logits[0]
        logp = torch.log_softmax(logits.double() / tau, -1)
        t = np.flatnonzero(s.train_mask)
        extra = s.token_extras[TEACHER_TOPK]
        for j, pos in enumerate(t):
            tl = ref_temper(extra.ids[j].tolist(), extra.logprobs[j].astype(np.float64).tolist(), tau)
            ref.append(ref_jsd(logp[pos - 1], extra.ids[j].tolist(), tl, int(s.input_ids[pos]), beta, True))
    ref_loss = torch.stack(ref).sum() / num_trained
    ref_loss.backward()
    want = grads(qwen3)
    assert float(ref_loss.detach()) > 0
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-4, atol=1e-6)
    assert got.keys() == want.keys() and len(want) > 0
    for name, g in want.items():
        torch.testing.assert_close(got[name], g.float(), rtol=1e-3, atol=1e-6, msg=name)
    assert float(raw["teacher/code/token_count"]) == 6 and float(raw["teacher/math/token_count"]) == 5
    assert float(raw["masked_sum"]) >= 2  # one reported-nothing position per sample
