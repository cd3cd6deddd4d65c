"""Cases of ``tests/test_fused_head.py`` that run the fused head's Triton kernels under Triton's interpreter.

Not collected on its own (no ``test_`` prefix): ``test_fused_head.py`` runs it in a child pytest with
``TRITON_INTERPRET=1``, because Triton decides at its import whether its kernels (its own library's included)
are compiled or interpreted, and other tests of the suite may import Triton first (through torch.compile).
fp32 inputs and IEEE dots: both heads agree to fp32 rounding.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from asyncgrpo_cli.model.chunked_head import ChunkedHeadFunction, LogitTransform
from asyncgrpo_cli.model.head import token_stats

pytest.importorskip("triton", reason="the fused head's kernels need Triton (its interpreter runs on CPU)")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_fused_head.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

TRANSFORMS = {
    "temperature": LogitTransform(temperature=0.7),
    "scale_softcap": LogitTransform(temperature=1.3, scale=0.5, softcap=3.0),
}


@pytest.fixture
def fused():
    return importlib.import_module("asyncgrpo_cli.model.fused_head")


def inputs(n=37, hidden=48, vocab=300, k=3, bias=False, seed=0):
    """Random fp32 head inputs; candidate ids include -1 padding and the vocabulary's first and last ids."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.3).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[:2] = torch.tensor([0, vocab - 1])[:n]
    cands = torch.randint(-1, vocab, (n, k), generator=gen)
    if k:
        cands[0, 0], cands[-1, -1] = vocab - 1, 0
    return h, w, b, targets, cands


def outputs_and_grads(fn, h, w, b, targets, cands, use_cands=True):
    """The head's three outputs and the gradients of Σ g·logprob + Σ g'·cand_logprob (live entries)."""
    logprobs, entropy, cand = fn(h, w, b, targets, cands)
    gen = torch.Generator().manual_seed(1)
    loss = (logprobs * torch.randn(logprobs.shape, generator=gen)).sum()
    if use_cands:
        loss = (
            loss + torch.where(torch.isfinite(cand), cand * torch.randn(cand.shape, generator=gen), 0).sum()
        )
    params = [x for x in (h, w, b) if x is not None]
    return (logprobs, entropy, cand), torch.autograd.grad(loss, params)


def assert_close_to_chunked(fused_fn, h, w, b, targets, cands, transform, use_cands=True):
    got, got_grads = outputs_and_grads(lambda *a: fused_fn(*a, transform), h, w, b, targets, cands, use_cands)
    ref, ref_grads = outputs_and_grads(
        lambda *a: ChunkedHeadFunction.apply(*a, None, transform, 64, 16), h, w, b, targets, cands, use_cands
    )
    for name, x, y in zip(("logprobs", "entropy", "candidates"), got, ref, strict=True):
        assert torch.equal(torch.isfinite(x), torch.isfinite(y)), name
        torch.testing.assert_close(
            torch.nan_to_num(x, neginf=0), torch.nan_to_num(y, neginf=0), atol=1e-5, rtol=1e-5
        )
    for x, y in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("transform", TRANSFORMS.values(), ids=TRANSFORMS.keys())
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_matches_the_chunked_head(fused, transform, bias):
    assert_close_to_chunked(fused.FusedHeadFunction.apply, *inputs(bias=bias), transform)


@pytest.mark.parametrize(
    "shape",
    [dict(n=1, vocab=33, k=0), dict(n=16, vocab=64, k=1), dict(n=70, vocab=257, hidden=20, k=5)],
    ids=["one_position", "exact_blocks", "ragged"],
)
def test_shapes_that_do_not_fill_blocks(fused, shape):
    """One position, N and V multiples of the blocks, and N, V, H that fill no block or vocabulary slice."""
    assert_close_to_chunked(fused.FusedHeadFunction.apply, *inputs(**shape), TRANSFORMS["temperature"])


def test_many_chunks_of_positions_and_vocabulary(fused, monkeypatch):
    """Forward chunks of 7 positions, backward tiles of 9 positions x 64 vocabulary entries (the last one 1 wide):
    the fp32 accumulation of grad_W over position chunks and of grad_h over vocabulary tiles."""
    monkeypatch.setattr(fused, "STATS_TILE_ELEMENTS", 7 * 257)
    monkeypatch.setattr(fused, "GRAD_VOCAB_CHUNK", 64)
    monkeypatch.setattr(fused, "GRAD_TILE_ELEMENTS", 9 * 64)
    assert_close_to_chunked(
        fused.FusedHeadFunction.apply,
        *inputs(n=40, vocab=257, hidden=20, k=3, bias=True),
        TRANSFORMS["temperature"],
    )


def test_gradient_through_the_target_alone(fused):
    assert_close_to_chunked(
        fused.FusedHeadFunction.apply, *inputs(), TRANSFORMS["scale_softcap"], use_cands=False
    )


def test_logprobs_are_normalized(fused):
    """exp(logprob) over every id of the vocabulary sums to 1 per position (the candidates are every id)."""
    h, w, _, targets, _ = inputs(n=5, vocab=80, k=0)
    every = torch.arange(80).expand(5, 80).contiguous()
    _, _, cand = fused.FusedHeadFunction.apply(h, w, None, targets, every, TRANSFORMS["temperature"])
    torch.testing.assert_close(cand.exp().sum(1), torch.ones(5), atol=1e-5, rtol=0)


def test_dispatch_runs_fused_where_asked_and_chunked_with_candidate_sets(fused):
    h, w, b, targets, cands = inputs(bias=True)
    t = TRANSFORMS["temperature"]
    stats = token_stats(h, w, targets, bias=b, transform=t, candidate_ids=cands, kernel="triton")
    ref = token_stats(h, w, targets, bias=b, transform=t, candidate_ids=cands, kernel="torch")
    assert not torch.equal(
        stats.logprobs, ref.logprobs
    )  # a different accumulation order: the fused kernels ran
    torch.testing.assert_close(stats.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
    support = torch.full((h.shape[0], 4), -1)
    support[:, 0] = targets
    support[:, 1:] = torch.randint(0, w.shape[0], (h.shape[0], 3))
    masked = token_stats(h, w, targets, transform=t, support_ids=support, kernel="triton")
    masked_ref = token_stats(h, w, targets, transform=t, support_ids=support, kernel="torch")
    assert torch.equal(masked.logprobs, masked_ref.logprobs)  # candidate sets run on the chunked head


def test_through_the_trainers_token_logprobs(fused):
    """The tiny Qwen3 on a sequence-packed row with sampler top-k: head_kernel=triton equals the chunked head
    (log-probs, entropies, top-k log-probs, the head's and a layer's gradients)."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.config.schema import PackingConfig
    from asyncgrpo_cli.model.logprobs import token_logprobs
    from asyncgrpo_cli.model.resolve import resolve_model_path
    from asyncgrpo_cli.packing.sequence import SequencePacker
    from tests.test_chunked_head import random_samples

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("builtin:tiny-qwen3"), dtype=torch.float32, attn_implementation="sdpa"
    )
    row = SequencePacker(PackingConfig()).pack(random_samples(model.config.vocab_size))
    results = []
    for kernel in ("triton", "torch"):
        model.zero_grad(set_to_none=True)
        stats = token_logprobs(model, row, 0.8, True, head_kernel=kernel)
        live = torch.isfinite(stats.topk_logprobs)
        (stats.logprobs.sum() + torch.where(live, stats.topk_logprobs, 0).exp().sum()).backward()
        grads = (model.get_output_embeddings().weight.grad, model.model.layers[0].mlp.up_proj.weight.grad)
        results.append((stats, [g.clone() for g in grads]))
    (got, got_grads), (ref, ref_grads) = results
    for name in ("logprobs", "entropy", "topk_logprobs"):
        x, y = getattr(got, name), getattr(ref, name)
        torch.testing.assert_close(
            torch.nan_to_num(x, neginf=0), torch.nan_to_num(y, neginf=0), atol=1e-5, rtol=1e-5
        )
    for x, y in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_candidates_that_repeat_the_target_or_each_other(fused):
    """A candidate equal to the target and two equal candidates: the gradients of every copy add up."""
    h, w, b, targets, cands = inputs(k=4)
    cands[:, 0] = targets
    cands[:, 2] = cands[:, 1]
    cands[::3, 3] = -1
    for transform in TRANSFORMS.values():
        assert_close_to_chunked(fused.FusedHeadFunction.apply, h, w, b, targets, cands, transform)


def test_no_trained_positions_give_zero_gradients(fused):
    _, w, b, _, _ = inputs(bias=True)
    h = torch.zeros(0, 48, requires_grad=True)
    targets, cands = torch.zeros(0, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long)
    logprobs, entropy, cand = fused.FusedHeadFunction.apply(
        h, w, b, targets, cands, TRANSFORMS["temperature"]
    )
    assert logprobs.shape == (0,) and entropy.shape == (0,) and cand.shape == (0, 3)
    grads = torch.autograd.grad(logprobs.sum() + cand.sum(), [h, w, b], allow_unused=True)
    assert (
        grads[0].shape == (0, 48)
        and torch.count_nonzero(grads[1]) == 0
        and torch.count_nonzero(grads[2]) == 0
    )


def test_autos_first_use_check_passes_on_working_kernels(fused):
    from asyncgrpo_cli.model import head

    head._checked.clear()
    for transform in TRANSFORMS.values():
        for bias in (None, torch.zeros(3)):
            assert head.fused_problem(torch.device("cpu"), torch.float32, 48, bias, transform, 4) is None
