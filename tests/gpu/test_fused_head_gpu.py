"""The fused Triton LM head on CUDA against the chunked head and an fp64 dense reference (bf16 and fp32)."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo_cli.model.head import token_stats
from asyncgrpo_cli.model.head_types import LogitTransform

pytestmark = pytest.mark.gpu


def make(n, hidden, vocab, k, dtype, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) / hidden**0.5 * 2
    b = torch.randn(vocab, generator=gen) * 0.1 if bias else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    cands = torch.randint(-1, vocab, (n, k), generator=gen)
    to = lambda x: None if x is None else x.cuda().to(dtype).requires_grad_()  # noqa: E731
    return to(h), to(w), to(b), targets.cuda(), cands.cuda()


def run(kernel, h, w, b, targets, cands, transform):
    stats = token_stats(h, w, targets, bias=b, transform=transform, candidate_ids=cands, kernel=kernel)
    gen = torch.Generator(device="cuda").manual_seed(1)
    live = torch.isfinite(stats.candidate_logprobs)
    loss = (stats.logprobs * torch.randn(stats.logprobs.shape, device="cuda", generator=gen)).sum()
    loss = loss + torch.where(live, stats.candidate_logprobs, 0).exp().sum()
    grads = torch.autograd.grad(loss, [x for x in (h, w, b) if x is not None])
    return stats, [g.double() for g in grads]


def reference(h, w, b, targets, cands, transform):
    """fp64 dense head on the same (rounded) inputs."""
    from asyncgrpo_cli.model.chunked_head import dense_token_stats

    leaves = [None if x is None else x.detach().double().requires_grad_() for x in (h, w, b)]
    stats = dense_token_stats(
        leaves[0], leaves[1], targets, bias=leaves[2], transform=transform, candidate_ids=cands
    )
    gen = torch.Generator(device="cuda").manual_seed(1)
    live = torch.isfinite(stats.candidate_logprobs)
    loss = (stats.logprobs * torch.randn(stats.logprobs.shape, device="cuda", generator=gen).double()).sum()
    loss = loss + torch.where(live, stats.candidate_logprobs, 0).exp().sum()
    grads = torch.autograd.grad(loss, [x for x in leaves if x is not None])
    return stats, grads


def rel(x, y):
    return float((x.double() - y).norm() / y.norm().clamp_min(1e-30))


@pytest.mark.parametrize(
    "shape,dtype,transform,bias",
    [
        ((4109, 1024, 151936, 8), torch.bfloat16, LogitTransform(0.7), False),
        ((1000, 2048, 49157, 3), torch.bfloat16, LogitTransform(1.0, scale=0.8, softcap=30.0), True),
        ((777, 256, 32011, 5), torch.float32, LogitTransform(0.9), True),
        ((9000, 256, 32011, 4), torch.bfloat16, LogitTransform(1.0), False),
    ],
    ids=["qwen3_vocab_bf16", "softcap_bias_bf16", "fp32", "two_position_chunks_bf16"],
)
def test_fused_head_is_at_least_as_close_to_fp64_as_the_chunked_head(shape, dtype, transform, bias):
    h, w, b, targets, cands = make(*shape, dtype, bias)
    ref, ref_grads = reference(h, w, b, targets, cands, transform)
    fused, fused_grads = run("triton", h, w, b, targets, cands, transform)
    chunked, chunked_grads = run("torch", h, w, b, targets, cands, transform)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for name in ("logprobs", "entropy", "candidate_logprobs"):
        want = torch.nan_to_num(getattr(ref, name), neginf=0)
        got = torch.nan_to_num(getattr(fused, name), neginf=0).double()
        other = torch.nan_to_num(getattr(chunked, name), neginf=0).double()
        assert torch.equal(torch.isfinite(getattr(fused, name)), torch.isfinite(getattr(ref, name))), name
        err, chunked_err = float((got - want).abs().max()), float((other - want).abs().max())
        assert err <= max(tol, 1.05 * chunked_err), (name, err, chunked_err)
    for got, other, want in zip(fused_grads, chunked_grads, ref_grads, strict=True):
        assert rel(got, want) <= max(2e-5 if dtype == torch.float32 else 1e-2, 1.1 * rel(other, want))


@pytest.mark.parametrize("transposed", [False, True])
def test_accumulate_mm_adds_the_product_in_place_in_fp32(transposed):
    """The backward's ``acc += a @ b`` (fp32 acc, bf16 a / b) in one cuBLAS call: into acc's own memory, with the
    product unrounded (closer to fp64 than adding the bf16-rounded product)."""
    from asyncgrpo_cli.model.fused_head import accumulate_mm

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(3000 if transposed else 700, 700 if transposed else 3000, device="cuda", generator=gen)
    a = (a.T if transposed else a).to(
        torch.bfloat16
    )  # the gradient tile's transpose (dx.T), as backward uses it
    b = torch.randn(3000, 512, device="cuda", generator=gen).to(torch.bfloat16)
    acc = torch.randn(700, 512, device="cuda", generator=gen)
    want = acc.double() + a.double() @ b.double()
    rounded = acc + (a @ b).float()
    ptr = acc.data_ptr()
    accumulate_mm(acc, a, b)
    assert acc.data_ptr() == ptr and acc.dtype == torch.float32
    err, rounded_err = (acc.double() - want).abs().max().item(), (rounded.double() - want).abs().max().item()
    assert err < 1e-3 and err < rounded_err, (err, rounded_err)


def test_token_logprobs_on_cuda_equal_the_chunked_head():
    """The tiny Qwen3 on CUDA (fp32): head_kernel=triton and torch agree through the decoder's gradients."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo_cli.config.schema import PackingConfig
    from asyncgrpo_cli.model.logprobs import token_logprobs
    from asyncgrpo_cli.model.resolve import resolve_model_path
    from asyncgrpo_cli.packing.tree import TreePacker
    from tests.test_chunked_head import random_samples

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("builtin:tiny-qwen3"), dtype=torch.float32, attn_implementation="sdpa"
    ).cuda()
    row = TreePacker(PackingConfig()).pack(random_samples(model.config.vocab_size)).to("cuda")
    out = []
    for kernel in ("triton", "torch"):
        model.zero_grad(set_to_none=True)
        stats = token_logprobs(model, row, 0.8, True, head_kernel=kernel)
        live = torch.isfinite(stats.topk_logprobs)
        (stats.logprobs.sum() + torch.where(live, stats.topk_logprobs, 0).exp().sum()).backward()
        out.append((stats.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp, grads), (lp_ref, grads_ref) = out
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], atol=1e-5, rtol=1e-4, msg=name)


def compiled_variants(kernel) -> int:
    """How many binaries Triton holds for ``kernel`` (its per-device caches; Triton 3.x)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no device_caches on its kernels")
    return sum(len(entry[0]) for entry in caches.values())


def test_position_counts_compile_no_new_kernel_variants():
    """The number of trained positions changes every step: a count divisible by 16 (or 1) must not compile another
    variant of either kernel (Triton specializes integer arguments by default)."""
    from asyncgrpo_cli.model import fused_head_kernels as kernels

    transform = LogitTransform(0.7)
    run("triton", *make(100, 256, 5003, 4, torch.bfloat16), transform)
    before = [compiled_variants(k) for k in (kernels.stats_kernel, kernels.grad_kernel)]
    for n in (128, 1, 256, 77, 4096):
        run("triton", *make(n, 256, 5003, 4, torch.bfloat16, seed=n), transform)
    assert [compiled_variants(k) for k in (kernels.stats_kernel, kernels.grad_kernel)] == before
