"""CUDA: compiled flex attention + the interval-built BlockMask equals SDPA + the dense mask on the same packed row
(log-probs and every parameter gradient, through the trainer's log-prob head with gradient checkpointing), on a
tree row of ~1.3k tokens (fp32, bf16), with kernel options (model.flex_kernel_options), on a row whose groups
share a system prompt, on ~8k-token tree and sequence rows (many 128-blocks, padding to the 8192 bucket), without
recompiling for a new row length in the same bucket, and through the trainer's loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.schema import LossConfig, ModelConfig, PackingConfig
from asyncgrpo_cli.model import flex_backend
from asyncgrpo_cli.model.flex import FLEX_IMPL, register_flex
from asyncgrpo_cli.model.logprobs import token_logprobs
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.packing.tree import TreePacker
from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK, TrainingSequence

pytestmark = pytest.mark.gpu
VOCAB = 512
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def fresh_flex():
    """Each test starts from an empty dynamo cache and leaves the default kernel options: these tests compile
    flex attention with many options, and past dynamo's recompile limit later tests (of this file or the next)
    would run the eager fallback, which syncs the host (a run compiles one set of options)."""
    from asyncgrpo_cli.model import flex

    torch._dynamo.reset()
    yield
    flex.set_kernel_options({})
    torch._dynamo.reset()


def groups(
    rng, num_groups: int, forks: int, prompt: int, completion: int, k: int = 3, system: int = 0
) -> list[TrainingSequence]:
    """GRPO groups: ``forks`` completions (completion .. 2 x completion tokens) below one prompt each; every
    third completion repeats the start of the previous one, so forks also happen inside completions. With
    ``system``, every prompt's first ``system`` tokens are one system prompt shared by the groups."""
    out = []
    shared = rng.integers(0, VOCAB, size=system) if system else None
    for g in range(num_groups):
        head = rng.integers(0, VOCAB, size=prompt)
        if shared is not None:
            head[:system] = shared
        for i in range(forks):
            tail = rng.integers(0, VOCAB, size=int(rng.integers(completion, 2 * completion)))
            if i % 3 == 2:
                tail[:5] = out[-1].input_ids[prompt : prompt + 5]
            ids = np.concatenate([head, tail]).astype(np.int64)
            mask = np.zeros(ids.shape[0], dtype=bool)
            mask[prompt:] = True
            n = int(mask.sum())
            out.append(TrainingSequence(
                input_ids=ids, train_mask=mask, sampler_logprobs=np.where(mask, -6.0, 0.0).astype(np.float32),
                advantage=float(i) - forks / 2, token_extras={SAMPLER_TOPK: TopK(rng.integers(0, VOCAB, size=(n, k)),
                rng.normal(-6, 1, size=(n, k)).astype(np.float32))}, group_id=g, prompt_seq=g,
            ))  # fmt: skip
    return out


def tiny_qwen3(dtype: torch.dtype, head_dim: int = 64):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=16384, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(CUDA, dtype)
    if hasattr(model, "activation_checkpointing_enable"):  # as model/loading.py does
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def run(model, row, impl: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs of the row and the gradients of a loss through log-probs and top-k log-probs, under ``impl``."""
    register_flex()
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    stats = token_logprobs(model, row, 0.7, with_topk=True)
    coef = torch.linspace(-1, 1, stats.logprobs.shape[0], device=CUDA)
    ((coef * stats.logprobs).sum() + stats.topk_logprobs.exp().sum()).backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.set_attn_implementation("sdpa")
    return stats.logprobs.detach().float(), grads


def assert_match(model, row, dtype: torch.dtype) -> None:
    ref_lp, ref_g = run(model, row, "sdpa")  # dense [T, T] mask
    lp, g = run(model, row, FLEX_IMPL)  # BlockMask, compiled flex, padded to flex_length(T)
    assert g.keys() == ref_g.keys() and len(g) > 0
    if dtype == torch.float32:
        torch.testing.assert_close(lp, ref_lp, atol=2e-4, rtol=2e-4)
        for name, ref in ref_g.items():
            torch.testing.assert_close(g[name], ref, atol=2e-4, rtol=2e-3, msg=name)
        return

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    assert rel(lp, ref_lp) < 1e-2, rel(lp, ref_lp)
    flat, ref_flat = (torch.cat([d[n].flatten() for n in ref_g]) for d in (g, ref_g))
    assert rel(flat, ref_flat) < 3e-2, rel(flat, ref_flat)
    for name, ref in ref_g.items():
        assert rel(g[name], ref) < 1e-1, (name, rel(g[name], ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_matches_sdpa_on_a_tree_row(dtype):
    rng = np.random.default_rng(0)
    row = (
        TreePacker(PackingConfig())
        .pack(groups(rng, num_groups=3, forks=8, prompt=150, completion=20))
        .to(CUDA)
    )
    assert 1000 < row.num_forwarded < 2048 and row.num_unpacked > 2 * row.num_forwarded
    assert_match(tiny_qwen3(dtype), row, dtype)


@pytest.mark.parametrize("options", ["fwd_64x64_w4", "bwd_64_w4"])
def test_flex_with_kernel_options_matches_sdpa(options):
    """model.flex_kernel_options (a ``bench attention`` candidate) changes the kernel's tiles, not its result."""
    from asyncgrpo_cli.bench.attention import merged_options
    from asyncgrpo_cli.model import flex

    row = TreePacker(PackingConfig()).pack(groups(np.random.default_rng(5), 3, 8, 150, 20)).to(CUDA)
    flex.set_kernel_options(merged_options(options))
    try:
        assert_match(tiny_qwen3(torch.float32), row, torch.float32)
    finally:
        flex.set_kernel_options({})


def test_the_tuned_options_of_this_gpu_match_sdpa_in_bf16():
    """model.flex_tuned_options (the default): 16-bit heads of a measured size get model/flex.py's TUNED_OPTIONS
    for this GPU; the result is SDPA's."""
    from asyncgrpo_cli.model import flex

    capability = torch.cuda.get_device_capability(CUDA)
    head_dims = list(flex.TUNED_OPTIONS.get(capability, {}))
    if not head_dims:
        pytest.skip(f"no tuned flex options for capability {capability}")
    row = TreePacker(PackingConfig()).pack(groups(np.random.default_rng(6), 3, 8, 150, 20)).to(CUDA)
    flex.set_kernel_options({}, tuned_for=CUDA)
    try:
        q = torch.empty(1, 4, 8, head_dims[0], dtype=torch.bfloat16, device=CUDA)
        assert flex.call_options(q) == flex.TUNED_OPTIONS[capability][head_dims[0]]
        assert_match(tiny_qwen3(torch.bfloat16, head_dims[0]), row, torch.bfloat16)
    finally:
        flex.set_kernel_options({})


def test_flex_matches_sdpa_on_a_row_sharing_a_system_prompt_across_groups():
    """4 groups whose prompts start with one 300-token system prompt: one trie per row forwards it once."""
    samples = groups(np.random.default_rng(4), num_groups=4, forks=6, prompt=350, completion=20, system=300)
    row = TreePacker(PackingConfig()).pack(samples)
    per_group = TreePacker(PackingConfig(share_across_groups=False)).pack(samples)
    assert row.num_forwarded == per_group.num_forwarded - 3 * 299
    assert_match(tiny_qwen3(torch.float32), row.to(CUDA), torch.float32)


def row_8k(kind: str, rng):
    """A packed row of ~8k forwarded tokens: a tree row of 2 groups of 16, or a sequence row of 6 samples."""
    if kind == "tree":
        return TreePacker(PackingConfig()).pack(
            groups(rng, num_groups=2, forks=16, prompt=1500, completion=80)
        )
    return SequencePacker(PackingConfig(kind="sequence")).pack(
        groups(rng, 1, forks=6, prompt=1100, completion=80)
    )


@pytest.mark.parametrize("kind", ["tree", "sequence"])
def test_flex_matches_sdpa_on_an_8k_row(kind):
    """~8k forwarded tokens: 60+ query blocks, full and partial blocks, q/k/v padded to the 8192 bucket."""
    row = row_8k(kind, np.random.default_rng(1))
    assert 6000 < row.num_forwarded <= 8192, row.num_forwarded
    assert_match(tiny_qwen3(torch.float32), row.to(CUDA), torch.float32)


def flash_or_skip() -> None:
    """Skip unless model.flex_backend=auto would pick FlashAttention-4 here (flash-attn-4, Hopper / Blackwell)."""

    if (
        flex_backend.resolve_flex_backend(
            "auto", torch.cuda.get_device_capability(CUDA), flex_backend.flash_installed()
        )
        != "flash"
    ):
        pytest.skip("model.flex_backend=flash: needs flash-attn-4 and a Hopper / Blackwell GPU")


@pytest.mark.parametrize("kind", ["tree", "system_prompt", "tree_8k", "sequence_8k"])
def test_flash_backend_matches_sdpa_in_bf16(kind):
    """model.flex_backend=flash: FlashAttention-4's kernels (torch's FLASH backend of flex) on the rows above, in
    bf16 (it has no fp32 kernels): log-probs and every gradient are SDPA's to bf16 rounding."""
    from asyncgrpo_cli.model import flex

    flash_or_skip()
    rng = np.random.default_rng(7)
    if kind == "tree":
        row = TreePacker(PackingConfig()).pack(groups(rng, num_groups=3, forks=8, prompt=150, completion=20))
    elif kind == "system_prompt":
        row = TreePacker(PackingConfig()).pack(groups(rng, 4, forks=6, prompt=350, completion=20, system=300))
    else:
        row = row_8k(kind.removesuffix("_8k"), rng)
    flex.set_kernel_options({}, tuned_for=CUDA, flash=True)
    try:
        q = torch.empty(1, 4, 8, 64, dtype=torch.bfloat16, device=CUDA)
        assert flex.call_options(q) == flex_backend.FLASH_OPTIONS
        assert_match(tiny_qwen3(torch.bfloat16), row.to(CUDA), torch.bfloat16)
    finally:
        flex.set_kernel_options({})


@pytest.mark.parametrize("heads", [(4, 2, 64), (16, 8, 128)])
def test_flash_passes_its_first_use_check(heads, tmp_path, monkeypatch):
    """model.flex_backend=auto's check (model/flex_backend.py): FlashAttention-4 on its small tree row agrees with
    SDPA in fp32, forward and backward, for the tiny test model's heads and the Qwen3 shapes'; the pass is
    recorded under this GPU's and these versions' stamp."""
    flash_or_skip()
    monkeypatch.setenv("ASYNCGRPO_CACHE", str(tmp_path))
    flex_backend._checked.clear()
    assert flex_backend.flash_problem(CUDA, *heads) is None
    stamp = flex_backend.check_stamp(CUDA, *heads)
    assert stamp is not None and torch.cuda.get_device_name(CUDA) in stamp
    assert flex_backend.passed_before() == {stamp}


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_a_new_row_length_in_the_same_bucket_does_not_recompile(backend):
    from asyncgrpo_cli.model import flex

    if backend == "flash":
        flash_or_skip()
    flex.set_kernel_options({}, tuned_for=CUDA, flash=backend == "flash")
    try:
        check_no_recompile()
    finally:
        flex.set_kernel_options({})


def check_no_recompile() -> None:
    """Two rows of different lengths in one bucket: the second compiles no new graph."""
    from torch._dynamo.utils import counters

    model = tiny_qwen3(torch.bfloat16)
    rng = np.random.default_rng(2)
    lengths = []
    for completion in (20, 30):  # two rows of different lengths, both in the 2048 bucket
        row = TreePacker(PackingConfig()).pack(groups(rng, 3, forks=8, prompt=150, completion=completion))
        lengths.append(row.num_forwarded)
        run(model, row.to(CUDA), FLEX_IMPL)
        if len(lengths) == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert lengths[0] != lengths[1] and all(1024 < n <= 2048 for n in lengths), lengths
    assert counters["stats"]["unique_graphs"] == graphs


def test_trainer_loader_and_step_use_flex_on_cuda(tmp_path):
    """load_policy with the default model.attn_implementation=auto picks flex; a trainer step runs through it,
    and a plain model(input_ids) call (the weight-sync probe) still works."""
    from asyncgrpo_cli.model import flex
    from asyncgrpo_cli.model.loading import load_policy
    from asyncgrpo_cli.train.losses import ClippedLoss
    from asyncgrpo_cli.train.step import forward_backward

    tiny_qwen3(torch.float32).save_pretrained(tmp_path)
    model = load_policy(str(tmp_path), ModelConfig(name_or_path=str(tmp_path), dtype="bfloat16"), CUDA)
    assert model.config._attn_implementation == FLEX_IMPL
    # model.flex_backend=auto: FlashAttention-4 where it runs, the Triton kernels elsewhere
    auto = flex_backend.resolve_flex_backend(
        "auto", torch.cuda.get_device_capability(CUDA), flex_backend.flash_installed()
    )
    assert bool(flex._FLASH) == (auto == "flash")
    samples = groups(np.random.default_rng(3), 2, forks=8, prompt=100, completion=20)
    rows = [samples[:8], samples[8:]]
    res = forward_backward(model, rows, sum(s.num_trained for s in samples), TreePacker(PackingConfig()),
                           ClippedLoss(LossConfig()), CUDA, temperature=1.0)  # fmt: skip
    assert np.isfinite(res.loss) and res.unpacked > res.forwarded
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        ids = torch.from_numpy(samples[0].input_ids)[None].to(CUDA)
        flex_logits = model(input_ids=ids, use_cache=False).logits.float()
        model.set_attn_implementation("sdpa")
        sdpa_logits = model(input_ids=ids, use_cache=False).logits.float()
    assert float((flex_logits - sdpa_logits).abs().max()) < 5e-2
