"""Chunked LM head: values and gradients equal a dense computation (float64 reference and the fp32 naive head),
top-k/top-p renormalization over candidate sets, bf16, memory, end to end through ``token_logprobs``."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from asyncgrpo_cli.bench import lm_head as bench
from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.model import chunked_head as chunked_head_mod
from asyncgrpo_cli.model.chunked_head import (
    LogitTransform,
    chunked_token_stats,
    dense_token_stats,
    pad_candidate_sets,
)
from asyncgrpo_cli.model.logprobs import token_logprobs
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK, TrainingSequence

NEG_INF = float("-inf")
N, H, V, K = 23, 16, 301, 5


# ---------------------------------------------------------------- inputs and references


def make_inputs(seed: int = 0, n: int = N, dtype=torch.float32, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.6).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.3).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (n,), generator=g)
    cands = torch.randint(0, V, (n, K), generator=g)
    cands[:, 0] = targets  # the sampled token is usually among the sampler's top-k
    cands[1:2, 3:] = -1  # padding
    return h, w, b, targets, cands


def make_support(targets: torch.Tensor, cands: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """Candidate sets of varying size holding the target, some top-k ids and random ids (with duplicates);
    rows 2 and 5 are all padding (full vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    n = targets.shape[0]
    support = torch.randint(0, V, (n, 12), generator=g)
    support[:, 0] = targets
    support[:, 1] = cands[:, 1]  # candidate 1 in the set, the others mostly not
    support[:, 2] = targets  # a duplicate
    sizes = torch.randint(3, 13, (n,), generator=g)
    support[torch.arange(12)[None, :] >= sizes[:, None]] = -1
    support[[2, 5]] = -1
    return support


def transform64(x: torch.Tensor, t: LogitTransform) -> torch.Tensor:
    z = x * (1.0 if t.scale is None else t.scale)
    if t.softcap is not None:
        z = torch.tanh(z / t.softcap) * t.softcap
    return z / t.temperature


def reference(h, w, b, targets, cands, support, transform):
    """float64, one position at a time: log-softmax over the full vocabulary or the distinct ids of the set."""
    x = F.linear(h.double(), w.double(), None if b is None else b.double())
    z = transform64(x, transform)
    lps, ents, cand_rows = [], [], []
    for i in range(z.shape[0]):
        ids = torch.arange(V)
        if support is not None and (support[i] >= 0).any():
            ids = support[i][support[i] >= 0].unique()
        log_z = torch.logsumexp(z[i, ids], 0)
        logp = z[i, ids] - log_z
        lps.append(z[i, targets[i]] - log_z)
        ents.append(-(logp.exp() * logp).sum().detach())
        allowed = torch.isin(cands[i], ids)
        cand_rows.append(torch.where(allowed, z[i, cands[i].clamp(min=0)] - log_z, NEG_INF))
    return torch.stack(lps), torch.stack(ents), torch.stack(cand_rows)


def objective(lps: torch.Tensor, cand: torch.Tensor | None) -> torch.Tensor:
    """A fixed scalar of every output, so gradients flow through target and candidate log-probs."""
    w = torch.linspace(-1, 1, lps.shape[0], dtype=lps.dtype, device=lps.device)
    out = (w * lps).sum()
    if cand is not None:
        out = out + torch.where(cand.isfinite(), cand.exp(), 0.0).sum()
    return out


def grads_of(outputs, params):
    lps, _, cand = outputs
    return torch.autograd.grad(objective(lps, cand), [p for p in params if p is not None])


# ---------------------------------------------------------------- chunked == dense


TRANSFORMS = {
    "plain": LogitTransform(),
    "temperature": LogitTransform(temperature=0.7),
    "scale_softcap": LogitTransform(temperature=1.3, scale=0.5, softcap=3.0),
}
CHUNKS = {"tiny_tiles": (7, 5), "vocab_split": (64, 1024), "one_tile": (4096, 1024), "one_position": (300, 1)}


@pytest.mark.parametrize("with_support", [False, True], ids=["full_vocab", "support"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("chunks", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("transform", TRANSFORMS.values(), ids=TRANSFORMS.keys())
def test_matches_dense_values_and_gradients(transform, chunks, bias, with_support):
    h, w, b, targets, cands = make_inputs(bias=bias)
    support = make_support(targets, cands) if with_support else None
    params = [h, w, b]
    out = chunked_token_stats(
        h,
        w,
        targets,
        bias=b,
        transform=transform,
        candidate_ids=cands,
        support_ids=support,
        vocab_chunk=chunks[0],
        position_chunk=chunks[1],
    )
    ref = reference(h, w, b, targets, cands, support, transform)
    naive = dense_token_stats(
        h, w, targets, bias=b, transform=transform, candidate_ids=cands, support_ids=support
    )
    for got, want, fp32 in zip(out, ref, naive, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.detach(), want.detach().float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.detach(), fp32.detach(), atol=1e-5, rtol=1e-5)
    assert bool((out.logprobs <= 0).all())
    if with_support:  # candidates outside their position's set get -inf
        outside = ~(cands[:, :, None] == support[:, None, :]).any(-1) & (support >= 0).any(1, keepdim=True)
        assert bool(outside.any()) and bool(out.candidate_logprobs[outside].isinf().all())
    for got, want, fp32 in zip(
        grads_of(out, params), grads_of(ref, params), grads_of(naive, params), strict=True
    ):
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, fp32, atol=1e-5, rtol=1e-5)


def test_candidate_set_is_a_distribution():
    """Over its own candidate set, the renormalized probabilities sum to 1 (each distinct id counted once)."""
    h, w, _, targets, cands = make_inputs()
    support = make_support(targets, cands)
    out = chunked_token_stats(h, w, targets, candidate_ids=support, support_ids=support, vocab_chunk=50)
    lp = out.candidate_logprobs.detach()
    c = support.shape[1]
    repeated = torch.stack(
        [torch.tensor([bool(row[:j].eq(row[j]).any()) for j in range(c)]) for row in support]
    )
    mass = torch.where(repeated | lp.isinf(), 0.0, lp.exp()).sum(1)
    has_set = (support >= 0).any(1)
    torch.testing.assert_close(mass[has_set], torch.ones(int(has_set.sum())), atol=1e-5, rtol=0)
    assert not bool(has_set[2]) and bool(lp[2].isinf().all())  # a row of padding: full vocabulary, no ids


def test_only_one_output_used():
    """Gradients when only the target log-probs, or only the candidate log-probs, reach the loss."""
    h, w, _, targets, cands = make_inputs()
    chunked = chunked_token_stats(h, w, targets, candidate_ids=cands, vocab_chunk=40, position_chunk=6)
    dense = dense_token_stats(h, w, targets, candidate_ids=cands)
    for pick in (
        lambda s: s.logprobs.sum(),
        lambda s: torch.where(s.candidate_logprobs.isfinite(), s.candidate_logprobs, 0).sum(),
    ):
        got = torch.autograd.grad(pick(chunked), [h, w], retain_graph=True)
        want = torch.autograd.grad(pick(dense), [h, w], retain_graph=True)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_entropy_is_logged_only_and_candidates_optional():
    h, w, _, targets, _ = make_inputs()
    out = chunked_token_stats(h, w, targets)
    assert out.candidate_logprobs is None
    assert out.logprobs.requires_grad and not out.entropy.requires_grad
    assert bool((out.entropy > 0).all()) and bool((out.entropy <= np.log(V) + 1e-5).all())


def test_frozen_head_gets_no_gradient():
    h, w, _, targets, cands = make_inputs()
    w = w.detach()
    out = chunked_token_stats(h, w, targets, candidate_ids=cands, vocab_chunk=64)
    (gh,) = torch.autograd.grad(objective(out.logprobs, out.candidate_logprobs), [h])
    ref = dense_token_stats(h, w, targets, candidate_ids=cands)
    (want,) = torch.autograd.grad(objective(ref.logprobs, ref.candidate_logprobs), [h])
    torch.testing.assert_close(gh, want, atol=1e-5, rtol=1e-5)


def test_no_positions():
    h, w, _, _, _ = make_inputs(n=0)
    out = chunked_token_stats(
        h, w, torch.zeros(0, dtype=torch.long), candidate_ids=torch.zeros(0, K, dtype=torch.long)
    )
    assert out.logprobs.shape == (0,) and out.candidate_logprobs.shape == (0, K)
    gh, gw = torch.autograd.grad(out.logprobs.sum(), [h, w])
    assert gh.shape == (0, H) and bool((gw == 0).all())


def test_bf16_inputs_accumulate_in_fp32():
    """bf16 hidden / weight: fp32 outputs close to the fp32 computation on the same values; bf16 gradients close
    to the naive bf16 head's."""
    h, w, b, targets, cands = make_inputs(dtype=torch.bfloat16, bias=True)
    out = chunked_token_stats(h, w, targets, bias=b, candidate_ids=cands, vocab_chunk=64, position_chunk=8)
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    h32, w32, b32 = (x.detach().float().requires_grad_() for x in (h, w, b))
    ref = reference(h32, w32, b32, targets, cands, None, LogitTransform())
    for got, want in zip(out, ref, strict=True):  # bf16 logits are rounded to 8 bits: |z| ~ 3 -> 0.01
        torch.testing.assert_close(got.detach(), want.detach().float(), atol=5e-2, rtol=0)
    naive = dense_token_stats(h, w, targets, bias=b, candidate_ids=cands)
    got, want = grads_of(out, [h, w, b]), grads_of(naive, [h, w, b])
    for g, r in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), r.float(), atol=2e-2, rtol=2e-2)


def test_saves_nothing_vocabulary_sized():
    """What autograd keeps: h, W, ids and log Z for the chunked head; the dense head keeps [N, V] logits."""

    def largest_saved(head) -> int:
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        h, w, _, targets, cands = make_inputs(n=400)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            head(h, w, targets, candidate_ids=cands)
        return max(sizes)

    chunked = largest_saved(lambda *a, **k: chunked_token_stats(*a, **k, vocab_chunk=64, position_chunk=32))
    assert chunked == max(400 * H, V * H)  # h or W
    assert largest_saved(dense_token_stats) >= 400 * V


def test_peak_memory_stays_within_tiles():
    """Forward+backward peak (torch CPU allocations, as the bench measures them) is far below one [N, V] fp32
    tensor for the chunked head, and above it for the dense head."""
    g = torch.Generator().manual_seed(0)
    n, v, hid = 1024, 16384, 16
    logits_bytes = n * v * 4
    h = torch.randn(n, hid, generator=g).requires_grad_()
    w = torch.randn(v, hid, generator=g).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)

    def step(head):
        def run():
            head(h, w, targets).logprobs.sum().backward()
            h.grad = w.grad = None

        return run

    chunked = bench.cpu_peak_bytes(
        step(lambda *a: chunked_token_stats(*a, vocab_chunk=1024, position_chunk=256))
    )
    dense = bench.cpu_peak_bytes(step(dense_token_stats))
    assert chunked < logits_bytes / 8, chunked
    assert dense > logits_bytes, dense


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("targets", V, "target id is outside"),
        ("targets", -1, "target id is outside"),
        ("cands", -2, "candidate id is outside"),
        ("cands", V, "candidate id is outside"),
        ("support", V + 3, "support id is outside"),
        ("support_target", None, "not in its position's candidate set"),
    ],
)
def test_rejects_bad_ids(field, value, match):
    h, w, _, targets, cands = make_inputs()
    support = make_support(targets, cands)
    if field == "targets":
        targets = targets.clone()
        targets[3] = value
    elif field == "cands":
        cands = cands.clone()
        cands[4, 2] = value
    elif field == "support":
        support[0, 0] = value
    else:
        support[0][support[0] == targets[0]] = (targets[0] + 1) % V
    with pytest.raises(ValueError, match=match):
        chunked_token_stats(h, w, targets, candidate_ids=cands, support_ids=support)


def test_pad_candidate_sets():
    ids = pad_candidate_sets([[5, 7, 9], None, [], [1]])
    assert ids.dtype == torch.long
    assert ids.tolist() == [[5, 7, 9], [-1, -1, -1], [-1, -1, -1], [1, -1, -1]]
    assert pad_candidate_sets([None, None]).shape == (2, 0)


# ---------------------------------------------------------------- end to end through token_logprobs


def random_samples(vocab: int, lengths=(9, 14, 6, 11), k: int = 4, seed: int = 0) -> list[TrainingSequence]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = np.arange(n) >= n // 3
        topk = rng.integers(0, vocab, size=(int(mask.sum()), k))
        topk[0, -1] = -1
        out.append(
            TrainingSequence(
                input_ids=rng.integers(0, vocab, size=n).astype(np.int64),
                train_mask=mask,
                sampler_logprobs=(rng.normal(-2, 0.5, size=n) * mask).astype(np.float32),
                advantage=(-1.0) ** i,
                token_extras={
                    SAMPLER_TOPK: TopK(
                        topk.astype(np.int64), rng.normal(-3, 1, size=topk.shape).astype(np.float32)
                    )
                },
            )
        )
    return out


def sampling_masks(samples: list[TrainingSequence], vocab: int, seed: int = 0) -> list[list[int] | None]:
    """Per trained token: a random candidate set holding the token and its first top-k ids (None for some)."""
    rng = np.random.default_rng(seed)
    sets: list[list[int] | None] = []
    for s in samples:
        for j, t in enumerate(np.flatnonzero(s.train_mask)):
            if rng.random() < 0.2:
                sets.append(None)
                continue
            extra = rng.integers(0, vocab, size=int(rng.integers(1, 30))).tolist()
            sets.append(
                [
                    int(s.input_ids[t]),
                    *[int(c) for c in s.token_extras[SAMPLER_TOPK].ids[j, :2] if c >= 0],
                    *extra,
                ]
            )
    return sets


def stock_reference(model, samples, temperature: float, support: torch.Tensor | None):
    """Per-sample stock forwards (full logits), log-softmax over the vocabulary or over each token's set."""
    lps, ents, topks, row = [], [], [], 0
    for s in samples:
        logits = model(input_ids=torch.from_numpy(s.input_ids)[None], use_cache=False).logits[0].float()
        t = torch.from_numpy(np.flatnonzero(s.train_mask))
        z = logits[t - 1] / temperature
        if support is not None:
            sets = support[row : row + len(t)]
            member = torch.zeros_like(z, dtype=torch.bool)
            for i, ids in enumerate(sets):
                member[i, ids[ids >= 0] if (ids >= 0).any() else slice(None)] = True
            z = z.masked_fill(~member, NEG_INF)
        row += len(t)
        logp = torch.log_softmax(z, dim=-1)
        lps.append(logp.gather(-1, torch.from_numpy(s.input_ids)[t][:, None]).squeeze(-1))
        ents.append(-torch.special.xlogy(logp.exp(), logp.exp()).sum(-1).detach())
        ids = torch.from_numpy(s.token_extras[SAMPLER_TOPK].ids)
        topks.append(logp.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, NEG_INF))
    return torch.cat(lps), torch.cat(ents), torch.cat(topks)


def param_grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).float()


@pytest.mark.parametrize("with_support", [False, True], ids=["full_vocab", "support"])
@pytest.mark.parametrize("gc", [False, True], ids=["plain", "grad_ckpt"])
@pytest.mark.parametrize("model_name", ["qwen3", "llama"])
def test_token_logprobs_end_to_end(model_name, gc, with_support, request, monkeypatch):
    """Small tiles (5 positions x 97 vocabulary entries): log-probs, entropies, top-k log-probs and every
    parameter's gradient equal per-sample stock forwards, tied (Qwen3) and untied (Llama), with and without
    gradient checkpointing and candidate sets."""
    model = request.getfixturevalue(model_name)
    assert model.config.tie_word_embeddings == (model_name == "qwen3")
    monkeypatch.setattr(chunked_head_mod, "POSITION_CHUNK", 5)
    monkeypatch.setattr(chunked_head_mod, "VOCAB_CHUNK", 97)
    model.train()
    if gc:
        model.activation_checkpointing_enable()
    else:
        model.activation_checkpointing_disable()
    vocab = model.config.vocab_size
    samples = random_samples(vocab)
    support = pad_candidate_sets(sampling_masks(samples, vocab)) if with_support else None
    try:
        ref = stock_reference(model, samples, 0.7, support)
        objective(ref[0], ref[2]).backward()
        want = param_grads(model)
        row = SequencePacker(PackingConfig()).pack(samples)
        stats = token_logprobs(model, row, 0.7, with_topk=True, support_ids=support)
        for got, exp in zip((stats.logprobs, stats.entropy, stats.topk_logprobs), ref, strict=True):
            torch.testing.assert_close(got.detach(), exp.detach(), atol=1e-5, rtol=1e-5)
        objective(stats.logprobs, stats.topk_logprobs).backward()
        got = param_grads(model)
    finally:
        model.activation_checkpointing_disable()
    assert got.keys() == want.keys() and len(want) > 0
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_head_must_be_a_plain_linear(llama):
    row = SequencePacker(PackingConfig()).pack(random_samples(llama.config.vocab_size))
    handle = llama.lm_head.register_forward_hook(lambda *a: None)
    try:
        with pytest.raises(TypeError, match="forward hooks"):
            token_logprobs(llama, row, 1.0, with_topk=False)
    finally:
        handle.remove()


# ---------------------------------------------------------------- bench and CUDA


def test_bench_prints_the_side_by_side_table(capsys):
    bench.main(
        ["--device", "cpu", "--shapes", "256x16x4096", "--dtypes", "fp32", "--repeats", "1"]
        + ["--vocab-chunk", "512", "--position-chunk", "64"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(
        "fused head (model.lm_head_kernel=triton): not run: the fused head runs on CUDA"
    )
    header = [c.strip() for c in lines[2].strip("|").split("|")]
    row = dict(zip(header, (c.strip() for c in lines[4].strip("|").split("|")), strict=True))
    assert row["fused ms"] == "-" and row["time fused/chunked"] == "-"
    assert row["N x H x V"] == "256 x 16 x 4096" and row["dtype"] == "fp32"
    assert float(row["naive peak MiB"]) > float(row["[N,V] fp32 MiB"]) > float(row["chunked peak MiB"])
    assert float(re.sub("x$", "", row["memory naive/chunked"])) > 2
    assert float(row["max abs Δ logprob"]) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_dense(dtype):
    h, w, b, targets, cands = (x.cuda() if x is not None else None for x in make_inputs(bias=True))
    h, w, b = (x.detach().to(dtype).requires_grad_() for x in (h, w, b))
    support = make_support(targets.cpu(), cands.cpu()).cuda()
    t = TRANSFORMS["scale_softcap"]
    out = chunked_token_stats(
        h,
        w,
        targets,
        bias=b,
        transform=t,
        candidate_ids=cands,
        support_ids=support,
        vocab_chunk=64,
        position_chunk=8,
    )
    naive = dense_token_stats(h, w, targets, bias=b, transform=t, candidate_ids=cands, support_ids=support)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in zip(out, naive, strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), atol=tol, rtol=tol)
    for got, want in zip(grads_of(out, [h, w, b]), grads_of(naive, [h, w, b]), strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
