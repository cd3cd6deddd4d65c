"""Gated-DeltaNet hybrids under sequence and tree packing (``model/gdn``): exact against unpacked transformers.

- the pieces: the recurrence plan of a row (segments, parents, path ancestors, chunk schedule), the path conv and
  the chunked tree delta rule on one segment equal transformers' own functions (fp32, values and grads, to 1e-6);
- the tiny Qwen3.5 hybrid (3 DeltaNet layers + 1 attention layer) and a tiny Qwen3-Next (its other projection
  layout, with MoE): packed log-probs equal one-sample-per-row transformers forwards, fp32 within 2e-5; every
  parameter gradient within fp32 noise (1e-3 of its largest entry + 1e-5: the decay parameters' gradients carry
  ~5e-6 of rounding on either side), and within 1e-4 relative with the recurrence in float64; bf16 within the
  stated tolerance;
- trees with several branch levels, a branch point inside the conv window (segments shorter than the kernel),
  identical samples and a sample that is another's prefix.
CUDA (fla kernels against this CPU path): tests/gpu/test_gdn_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

from asyncgrpo_cli.config.schema import ModelConfig, PackingConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.model.gdn.conv import path_conv
from asyncgrpo_cli.model.gdn.layer import install, linear_attention_modules, resolve_kernel
from asyncgrpo_cli.model.gdn.plan import build_plan, segments
from asyncgrpo_cli.model.gdn.rule_torch import tree_chunk_gated_delta_rule
from asyncgrpo_cli.model.logprobs import token_logprobs
from asyncgrpo_cli.model.resolve import resolve_model_path
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.packing.tree import TreePacker
from asyncgrpo_cli.samples import TrainingSequence

VOCAB = 1000


def sample(ids, prompt: int, adv: float = 1.0, group: int = 0) -> TrainingSequence:
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.zeros(len(ids), bool)
    mask[prompt:] = True
    return TrainingSequence(ids, mask, np.zeros(len(ids), np.float32), advantage=adv, group_id=group)


def branching_samples(seed: int = 0) -> list[TrainingSequence]:
    """Two groups. Group 0: a 70-token prompt (past one 64-token chunk), completions forking at several depths,
    one fork two tokens after another (a segment shorter than the conv kernel), a duplicate and a prefix sample.
    Group 1: an unrelated short sample."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 70).tolist()
    a = rng.integers(0, VOCAB, 90).tolist()
    b = a[:2] + rng.integers(0, VOCAB, 30).tolist()  # forks 2 tokens into a's completion
    c = a[:2] + b[2:3] + rng.integers(0, VOCAB, 12).tolist()  # forks 1 token into b's branch
    d = rng.integers(0, VOCAB, 5).tolist()
    out = [sample(prompt + x, 70, adv=i - 2.0) for i, x in enumerate((a, b, c, d))]
    out.append(sample(prompt + a, 70, adv=0.5))  # identical to the first
    out.append(sample(prompt + a[:40], 70, adv=-0.5))  # a prefix of the first
    out.append(
        sample(prompt[:66] + rng.integers(0, VOCAB, 20).tolist(), 60, adv=1.5)
    )  # forks inside the prompt
    out.append(sample(rng.integers(0, VOCAB, 50).tolist(), 10, adv=0.25, group=1))
    return out


def cross_group_samples(seed: int = 0) -> list[TrainingSequence]:
    """Groups of one row sharing prefixes across groups, interleaved: a 70-token system prompt (past one chunk)
    before groups 0 and 1's questions; group 2 shares only its first 66 tokens (a fork two tokens past the first
    chunk, inside the conv window); group 3's whole prompt is a prefix of group 0's; group 4's prompt is group
    0's (one completion identical to one of group 0's); group 5 is multi-turn, trained turns around an untrained
    tool reply."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, 70).tolist()
    prompts = {
        0: system + rng.integers(0, VOCAB, 6).tolist(),
        1: system + rng.integers(0, VOCAB, 2).tolist(),
        2: system[:66] + rng.integers(0, VOCAB, 5).tolist(),
    }
    prompts[3] = prompts[0][:73]
    prompts[4] = list(prompts[0])
    common = rng.integers(0, VOCAB, 8).tolist()
    out = []
    for g, prompt in prompts.items():
        for i in range(2):
            comp = common if (g in (0, 4) and i == 0) else rng.integers(0, VOCAB, 5 + 7 * i).tolist()
            out.append(sample(prompt + comp, len(prompt), adv=float(rng.normal()), group=g))
    turn1, tool = rng.integers(0, VOCAB, 6).tolist(), rng.integers(0, VOCAB, 3).tolist()
    for i in range(2):
        s = sample(system + turn1 + tool + rng.integers(0, VOCAB, 4 + i).tolist(), 70, adv=0.5 - i, group=5)
        s.train_mask[76:79] = False  # the tool reply is context
        out.append(s)
    return [out[i] for i in rng.permutation(len(out))]


@pytest.fixture(scope="module")
def hybrid_dir():
    return resolve_model_path("builtin:tiny-qwen3.5")


def load(path, dtype=torch.float32, packed: bool = True):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    if packed:
        install(model, "torch")
    return model


def unpacked(model, samples) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs of every trained token (in sample order) and the gradient of their advantage-weighted sum, one
    sample per transformers forward (the stock layers: no plan)."""
    model.zero_grad()
    out = []
    for s in samples:
        ids = torch.as_tensor(s.input_ids)[None]
        logits = model(ids, use_cache=False).logits[0].float().log_softmax(-1)
        t = np.flatnonzero(s.train_mask)
        lp = logits[t - 1, ids[0, t]]
        (lp.sum() * s.advantage).backward()
        out.append(lp.detach())
    return torch.cat(out), {n: p.grad.clone() for n, p in model.named_parameters()}


def packed(model, samples, packer) -> tuple[torch.Tensor, dict[str, torch.Tensor], object]:
    model.zero_grad()
    row = packer.pack(samples)
    lp = token_logprobs(model, row, 1.0, False).logprobs
    (lp * row.advantages).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, row


PACKERS = {
    "sequence": lambda: SequencePacker(PackingConfig()),
    "tree": lambda: TreePacker(PackingConfig(kind="tree")),
}


def grad_errors(got: dict, want: dict) -> dict[str, float]:
    return {n: float((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-30)) for n, w in want.items()}


# ---- the plan ------------------------------------------------------------------------------------------------


def test_segments_of_the_worked_tree_example():
    """packing/tree.py's example: r0 = p1 p2 p3 a1 a2, r1 = p1 p2 p3 b1 b2 -> S0 = [0, 2), S1 = [2, 5), S2 = [5, 8)."""
    leave = np.array([8, 8, 5, 5, 5, 8, 8, 8])
    start, end, parent = segments(leave)
    assert start.tolist() == [0, 2, 5] and end.tolist() == [2, 5, 8] and parent.tolist() == [-1, 0, 0]
    plan = build_plan(torch.as_tensor(leave), conv_taps=4)
    # the first branch token of S2 (index 5) steps up to p2 (index 1), not to its packed neighbour a2
    assert plan.ancestors[:, 5].tolist() == [1, 0, 8]
    assert plan.ancestors[:, 3].tolist() == [2, 1, 0]
    assert [len(lv) for lv in plan.segment_levels] == [1, 2]


def test_sequence_rows_have_one_root_segment_per_sample():
    leave = torch.tensor([3, 3, 3, 5, 5])
    plan = build_plan(leave, conv_taps=3)
    assert plan.seg_parent.tolist() == [-1, -1]
    assert plan.ancestors.tolist() == [[5, 0, 1, 5, 3], [5, 5, 0, 5, 5]]
    assert [m.tolist() for m in plan.levels] == [[0, 1]]  # two independent chunks: one scan step


def test_chunk_schedule_follows_paths_not_the_row():
    """A 70-token root (2 chunks) with two 10-token branches: the branches' chunks both start from the root's
    second chunk, in one batched step."""
    leave = torch.tensor([90] * 70 + [80] * 10 + [90] * 10)
    plan = build_plan(leave, conv_taps=4)
    assert plan.num_chunks == 4
    assert [m.tolist() for m in plan.levels] == [[0], [1], [2, 3]]
    # level 0 reads the zero state (its bank holds only it); later levels index the previous level's end states
    assert [i.tolist() for i in plan.level_inputs] == [[0], [0], [0, 0]]


def test_a_moved_row_plans_from_its_host_leave_without_reading_the_device():
    """``PackedRow.to`` keeps the CPU ``leave``; the plan is built from it with its tensors on the row's device
    (``meta`` here: reading the moved ``leave`` would raise), the same plan as from the row on the CPU."""
    from types import SimpleNamespace

    from asyncgrpo_cli.model.gdn import PLAN_KWARG, recurrence_kwargs

    row = TreePacker(PackingConfig()).pack(branching_samples())
    assert row.host_leave is None
    moved = row.to("meta", non_blocking=True)
    assert moved.leave.is_meta and moved.host_leave is row.leave
    assert row.to("cpu").host_leave is None
    model = SimpleNamespace(_asyncgrpo_gdn_taps=4)
    want, got = (recurrence_kwargs(model, r)[PLAN_KWARG] for r in (row, moved))
    assert got.ancestors.is_meta and got.grid_index.is_meta
    for name in ("seg_start", "seg_end", "seg_parent"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    assert [m.tolist() for m in got.segment_levels] == [m.tolist() for m in want.segment_levels]
    assert got.ancestors.shape == want.ancestors.shape and got.num_chunks == want.num_chunks


# ---- the pieces against transformers ---------------------------------------------------------------------------


def test_one_segment_rule_equals_transformers():
    torch.manual_seed(0)
    n, hk, hv, d = 150, 2, 4, 16
    q, k = (torch.randn(n, hk, d, requires_grad=True) for _ in range(2))
    v = torch.randn(n, hv, d, requires_grad=True)
    g = (-torch.rand(n, hv)).requires_grad_()
    beta = torch.rand(n, hv).requires_grad_()
    want, _ = mq.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], use_qk_l2norm_in_kernel=True
    )
    weight = torch.randn_like(want[0])
    want_grads = torch.autograd.grad((want[0] * weight).sum(), [q, k, v, g, beta])
    got = tree_chunk_gated_delta_rule(q, k, v, g, beta, build_plan(torch.full((n,), n), 4))
    got_grads = torch.autograd.grad((got * weight).sum(), [q, k, v, g, beta])
    assert (got - want[0]).abs().max() < 1e-6  # the same algebra: bitwise without grouped value heads
    for a, b in zip(got_grads, want_grads, strict=True):
        assert (a - b).abs().max() < 1e-5 * max(1.0, float(b.abs().max()))


def test_packed_rule_equals_separate_sequences_with_state_handoff():
    """Two root samples and a branch: each equals transformers on its own path (the branch from its parent's
    final state), gradients included (the parent gets both branches' gradients)."""
    torch.manual_seed(1)
    root, b1, b2 = 70, 30, 9
    n = root + b1 + b2
    leave = torch.tensor([n] * root + [root + b1] * b1 + [n] * b2)
    h, d = 2, 8
    q, k, v = (torch.randn(n, h, d, requires_grad=True) for _ in range(3))
    g = (-torch.rand(n, h)).requires_grad_()
    beta = torch.rand(n, h).requires_grad_()
    got = tree_chunk_gated_delta_rule(q, k, v, g, beta, build_plan(leave, 4))
    weight = torch.randn_like(got)
    got_grads = torch.autograd.grad((got * weight).sum(), [q, k, v, g, beta])

    def path(ix):
        ix = torch.as_tensor(ix)
        out, _ = mq.torch_chunk_gated_delta_rule(
            *(x[ix][None] for x in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True
        )
        return out[0]

    first = list(range(root + b1))
    second = list(range(root)) + list(range(root + b1, n))
    ref1, ref2 = path(first), path(second)
    want = torch.cat([ref1, ref2[root:]])
    assert (got - want).abs().max() < 2e-6
    # gradient of the same objective computed through the two unpacked paths (the root's outputs once)
    obj = (ref1 * weight[first]).sum() + (ref2[root:] * weight[root + b1 :]).sum()
    want_grads = torch.autograd.grad(obj, [q, k, v, g, beta])
    for a, b in zip(got_grads, want_grads, strict=True):
        assert (a - b).abs().max() < 1e-5 * max(1.0, float(b.abs().max()))


def test_path_conv_equals_transformers_on_one_sequence():
    torch.manual_seed(2)
    n, c, taps = 40, 24, 4
    x = torch.randn(n, c, requires_grad=True)
    w = torch.randn(c, taps, requires_grad=True)
    want = mq.causal_conv1d_fn(x.T[None], w, None, activation="silu")[0].T
    got = path_conv(x, w, None, "silu", build_plan(torch.full((n,), n), taps))
    assert (got - want).abs().max() < 1e-6


# ---- the model -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sequence", "tree"])
def test_tiny_hybrid_packed_equals_unpacked_fp32(hybrid_dir, kind):
    samples = branching_samples()
    model = load(hybrid_dir)
    want_lp, want_grads = unpacked(model, samples)
    got_lp, got_grads, row = packed(model, samples, PACKERS[kind]())
    if kind == "tree":
        assert row.num_forwarded < row.num_unpacked  # prefixes were shared
    assert (got_lp - want_lp).abs().max() < 2e-5
    # fp32: within 1e-3 of each parameter's largest gradient, plus 1e-5 absolute: the decay parameters' gradients
    # carry ~5e-6 of fp32 rounding on the unpacked side as well (measured against a float64 recurrence), which
    # is most of a gradient as small as 5e-6 (the float64 test below is the tight one)
    for name, want in want_grads.items():
        err = float((got_grads[name] - want).abs().max())
        assert err <= 1e-3 * float(want.abs().max()) + 1e-5, (name, err, float(want.abs().max()))


def test_tiny_hybrid_cross_group_tree_equals_unpacked_fp32(hybrid_dir):
    """Groups sharing a system prompt (and parts of it, a prompt prefix, identical prompts, multi-turn) in one
    row trie: the recurrence plan from the row's DFS intervals treats every path apart, as for one group."""
    samples = cross_group_samples()
    model = load(hybrid_dir)
    want_lp, want_grads = unpacked(model, samples)
    got_lp, got_grads, row = packed(model, samples, PACKERS["tree"]())
    per_group = TreePacker(PackingConfig(share_across_groups=False)).pack(samples)
    assert row.num_forwarded <= per_group.num_forwarded - 4 * 65  # the system prompt once, not once per group
    assert (got_lp - want_lp).abs().max() < 2e-5
    for (
        name,
        want,
    ) in want_grads.items():  # the fp32 tolerance of test_tiny_hybrid_packed_equals_unpacked_fp32
        err = float((got_grads[name] - want).abs().max())
        assert err <= 1e-3 * float(want.abs().max()) + 1e-5, (name, err, float(want.abs().max()))


def test_tiny_hybrid_tree_equals_unpacked_in_float64(hybrid_dir, monkeypatch):
    """With the recurrence in float64 on both sides (transformers' chunk function, which casts to fp32, replaced
    by this module's rule on one segment: equal to it in fp32, see above), every gradient matches tightly:
    the fp32 differences of the decay parameters are rounding, not a leak."""

    def rule64(query, key, value, g, beta, **_):
        n = query.shape[1]
        out = tree_chunk_gated_delta_rule(
            query[0], key[0], value[0], g[0], beta[0], build_plan(torch.full((n,), n), 4)
        )
        return out[None], None

    monkeypatch.setattr(mq, "torch_chunk_gated_delta_rule", rule64)
    samples = branching_samples(seed=3)
    model = load(hybrid_dir, dtype=torch.float64)
    want_lp, want_grads = unpacked(model, samples)
    got_lp, got_grads, _ = packed(model, samples, PACKERS["tree"]())
    assert (got_lp - want_lp).abs().max() < 2e-5  # the LM head is fp32
    assert max(grad_errors(got_grads, want_grads).values()) < 1e-4


def test_tiny_hybrid_tree_bf16_within_tolerance(hybrid_dir):
    """bf16 weights and activations (the recurrence in fp32, as transformers and fla): tree-packed log-probs stay
    within 0.05 of the unpacked bf16 forward (bf16 rounding of the layer outputs); mean difference < 0.01."""
    samples = branching_samples(seed=4)
    model = load(hybrid_dir, dtype=torch.bfloat16)
    want_lp, _ = unpacked(model, samples)
    got_lp, _, _ = packed(model, samples, PACKERS["tree"]())
    diff = (got_lp - want_lp).abs()
    assert diff.max() < 0.05 and diff.mean() < 0.01, (diff.max(), diff.mean())


def test_without_the_packed_forward_sequence_packing_leaks(hybrid_dir):
    """The reason for all of this: the stock layers run their conv and state across the packed row."""
    samples = branching_samples()
    model = load(hybrid_dir, packed=False)
    want_lp, _ = unpacked(model, samples)
    got_lp, _, _ = packed(model, samples, PACKERS["sequence"]())
    assert (got_lp - want_lp).abs().max() > 1e-3


def tiny_qwen3_next(tmp_path):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3NextForCausalLM(config).save_pretrained(tmp_path)
    return tmp_path


def test_qwen3_next_layout_packs_exactly(tmp_path):
    """Qwen3-Next's fused qkvz / ba projections (the other layout), with its MoE blocks."""
    path = tiny_qwen3_next(tmp_path)
    samples = branching_samples(seed=5)
    model = load(path)
    assert [i for i, _ in linear_attention_modules(model)] == [0, 1, 3]
    want_lp, _ = unpacked(model, samples)
    got_lp, _, _ = packed(model, samples, PACKERS["tree"]())
    assert (got_lp - want_lp).abs().max() < 2e-5


def test_loader_installs_the_packed_forward(hybrid_dir):
    from asyncgrpo_cli.model.loading import load_policy
    from asyncgrpo_cli.model.logprobs import _decoder

    model = load_policy(hybrid_dir, ModelConfig(name_or_path=hybrid_dir), torch.device("cpu"))
    modules = [m for _, m in linear_attention_modules(model)]
    assert [i for i, _ in linear_attention_modules(model)] == [0, 1, 2]
    # one class (one forward) for every layer: a compiled decoder layer does not guard on a per-layer function
    assert len({type(m) for m in modules}) == 1 and type(modules[0]).__name__ == "PackedQwen3_5GatedDeltaNet"
    samples = branching_samples(seed=6)
    row = PACKERS["tree"]().pack(samples)
    lp = token_logprobs(model, row, 1.0, False).logprobs
    reference = load(hybrid_dir, packed=False)
    want, _ = unpacked(reference, samples)
    assert (lp.detach() - want).abs().max() < 2e-5
    assert _decoder(model) is model.model


def test_kernel_choice():
    assert resolve_kernel("auto", torch.device("cpu")) == "torch"
    assert resolve_kernel("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="linear_attention_kernel=fla cannot run: the trainer runs on CPU"):
        resolve_kernel("fla", torch.device("cpu"))
    with pytest.raises(ValueError, match="use one of auto, torch, fla"):
        resolve_kernel("triton", torch.device("cpu"))


def test_loader_names_the_key_for_an_impossible_kernel(hybrid_dir):
    from asyncgrpo_cli.model.loading import load_policy

    cfg = ModelConfig(name_or_path=hybrid_dir, linear_attention_kernel="fla")
    with pytest.raises(UserError, match="model.linear_attention_kernel=fla"):
        load_policy(hybrid_dir, cfg, torch.device("cpu"))


def reference_fla_kernel(
    q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    cu_seqlens=None, cu_seqlens_cpu=None,
):  # fmt: skip
    """fla's ``chunk_gated_delta_rule`` contract (varlen ``cu_seqlens``, a state per sequence in and out) on CPU,
    from transformers' torch function one sequence at a time: lets the level orchestration of ``rule_fla`` run
    here (the Triton kernels themselves: tests/gpu/test_gdn_gpu.py)."""
    outs, finals = [], []
    bounds = cu_seqlens_cpu.tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        h0 = None if initial_state is None else initial_state[i : i + 1]
        out, final = mq.torch_chunk_gated_delta_rule(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )  # fmt: skip
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, dim=1), torch.cat(finals) if output_final_state else None


def test_fla_level_orchestration_with_a_reference_kernel(monkeypatch):
    """``rule_fla`` (one varlen call per segment-tree level, parents' final states in) equals the chunk-grid rule
    on a three-level tree and on a sequence row, values and gradients."""
    import sys
    import types

    fake = types.ModuleType("fla.ops.gated_delta_rule")
    fake.chunk_gated_delta_rule = reference_fla_kernel
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    from asyncgrpo_cli.model.gdn.rule_fla import fla_tree_gated_delta_rule

    row = PACKERS["tree"]().pack(branching_samples(seed=7))
    seq_row = PACKERS["sequence"]().pack(branching_samples(seed=7))
    for leave in (row.leave, seq_row.leave):
        plan = build_plan(leave, 4)
        n = plan.num_tokens
        torch.manual_seed(3)
        inputs = [
            torch.randn(n, 2, 8),
            torch.randn(n, 2, 8),
            torch.randn(n, 4, 8),
            -torch.rand(n, 4),
            torch.rand(n, 4),
        ]
        inputs = [x.requires_grad_() for x in inputs]
        got = fla_tree_gated_delta_rule(*inputs, plan)
        weight = torch.randn_like(got)
        got_grads = torch.autograd.grad((got * weight).sum(), inputs)
        want = tree_chunk_gated_delta_rule(*inputs, plan)
        want_grads = torch.autograd.grad((want * weight).sum(), inputs)
        assert (got - want).abs().max() < 1e-5
        for a, b in zip(got_grads, want_grads, strict=True):
            assert (a - b).abs().max() < 1e-4 * max(1.0, float(b.abs().max()))
    assert len(build_plan(row.leave, 4).segment_levels) >= 3


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_hybrid_with_flex_attention_block_mask(hybrid_dir):
    """Flex attention (the CUDA default) hands its BlockMask to the attention layers only: the hybrid decoder gets a
    mask per layer type (it would otherwise derive a recurrent-layer mask from the BlockMask and fail). Forward
    on CPU (flex has no CPU backward)."""
    from asyncgrpo_cli.model.flex import FLEX_IMPL, register_flex

    register_flex()
    samples = branching_samples(seed=8)
    row = PACKERS["tree"]().pack(samples)
    want = token_logprobs(load(hybrid_dir), row, 1.0, False).logprobs
    model = AutoModelForCausalLM.from_pretrained(
        hybrid_dir, dtype=torch.float32, attn_implementation=FLEX_IMPL
    )
    install(model, "torch")
    with torch.no_grad():
        got = token_logprobs(model, row, 1.0, False).logprobs
    assert (got - want.detach()).abs().max() < 1e-4


def test_a_vision_language_checkpoint_syncs_under_its_own_names(hybrid_dir, tmp_path):
    """Released Qwen3.5 checkpoints are ``Qwen3_5ForConditionalGeneration``: the trainer loads the text decoder
    (``model.layers.*``) and weight sync renames to the checkpoint's ``model.language_model.*`` (what a server
    serving that checkpoint loads); a text-only checkpoint keeps its names. The vLLM run: tests/vllm."""
    from transformers import AutoConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from asyncgrpo_cli.model.loading import checkpoint_name, load_policy

    text = AutoConfig.from_pretrained(hybrid_dir).to_dict()
    for key in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype"):
        text.pop(key, None)
    vision = dict(
        depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=text["hidden_size"]
    )
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(
        tmp_path
    )
    model = load_policy(str(tmp_path), ModelConfig(name_or_path=str(tmp_path)), torch.device("cpu"))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    name = "model.layers.0.linear_attn.A_log"
    assert checkpoint_name(model, name) == "model.language_model.layers.0.linear_attn.A_log"
    assert checkpoint_name(model, "lm_head.weight") == "lm_head.weight"
    plain = load_policy(hybrid_dir, ModelConfig(name_or_path=hybrid_dir), torch.device("cpu"))
    assert checkpoint_name(plain, name) == name
