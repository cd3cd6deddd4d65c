"""Tree packing: the reference's worked example, layout properties over random tries, and tree-packed log-probs
and gradients equal to per-sample unpacked forwards (tiny Qwen3 and Llama, fp32, CPU)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.model.logprobs import token_logprobs
from asyncgrpo_cli.packing import planner_for
from asyncgrpo_cli.packing.attention import (
    dense_mask,
    segment_leave,
    sequence_leave,
    token_leave,
    tree_mask_mod,
)
from asyncgrpo_cli.packing.planner import TokenBudgetPlanner
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.packing.tree import TreePacker, TreeRow, tree_layout
from asyncgrpo_cli.packing.tree_planner import GroupTreeBudgetPlanner, TreeBudgetPlanner
from asyncgrpo_cli.packing.trie import GroupTrie
from asyncgrpo_cli.samples import SAMPLER_TOPK, TopK, TrainingSequence

NEG_INF = float("-inf")


def sample(
    ids, trained_from: int | None = None, adv: float = 0.0, group: int = 0, k: int = 0, rng=None, mask=None
):
    """A sample training tokens [trained_from, L) (none when None; or the bool ``mask``); top-k rows of width k
    when k > 0."""
    ids = np.asarray(ids, dtype=np.int64)
    if mask is None:
        mask = np.zeros(ids.shape[0], dtype=bool)
        if trained_from is not None:
            mask[trained_from:] = True
    n = int(mask.sum())
    rng = rng or np.random.default_rng(0)
    topk_ids = topk_lps = None
    if k:
        topk_ids = rng.integers(0, 50, size=(n, k))
        topk_ids[rng.random((n, k)) < 0.2] = -1
        topk_lps = rng.normal(-3, 1, size=(n, k)).astype(np.float32)
    return TrainingSequence(
        input_ids=ids,
        train_mask=mask,
        sampler_logprobs=(rng.normal(-2, 0.5, size=ids.shape[0]) * mask).astype(np.float32),
        advantage=adv,
        token_extras={} if topk_ids is None else {SAMPLER_TOPK: TopK(topk_ids, topk_lps)},
        group_id=group,
        prompt_seq=group,
    )


def pack(samples, share_across_groups: bool = True) -> TreeRow:
    return TreePacker(PackingConfig(kind="tree", share_across_groups=share_across_groups)).pack(samples)


# ---------------------------------------------------------------- exact layouts


def test_reference_worked_example():
    p1, p2, p3, a1, a2, b1, b2 = 11, 12, 13, 21, 22, 31, 32
    r0 = sample([p1, p2, p3, a1, a2], trained_from=3, adv=1.0)
    r1 = sample([p1, p2, p3, b1, b2], trained_from=3, adv=-1.0)
    row = pack([r0, r1])
    assert row.input_ids.tolist() == [[p1, p2, p3, a1, a2, p3, b1, b2]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 4]]
    assert row.segment_offsets.tolist() == [0, 2, 5, 8]  # S0 = [p1 p2], S1 = [p3 a1 a2], S2 = [p3 b1 b2]
    assert row.segment_parents.tolist() == [-1, 0, 0]
    mask = row.attention_mask[0, 0]
    keys = {0: [0, 1], 1: [0, 1, 2, 3, 4], 2: [0, 1, 5, 6, 7]}  # K/V rows of each segment's path
    for seg, (lo, hi) in enumerate([(0, 2), (2, 5), (5, 8)]):
        for q in range(lo, hi):
            assert torch.nonzero(mask[q]).flatten().tolist() == [k for k in keys[seg] if k <= q], q
    assert row.pred_index.tolist() == [2, 3, 5, 6]
    assert row.target_ids.tolist() == [a1, a2, b1, b2]
    assert row.advantages.tolist() == [1.0, 1.0, -1.0, -1.0]
    assert (row.num_forwarded, row.num_unpacked, row.num_trained, row.num_samples) == (8, 10, 4, 2)


def test_one_position_predicts_several_targets():
    """Identical samples and a sample that is a prefix of another share positions, each with its own terms."""
    a = sample([5, 6, 7, 8], trained_from=2, adv=1.0)
    same = sample([5, 6, 7, 8], trained_from=2, adv=-2.0)
    prefix = sample([5, 6, 7], trained_from=1, adv=3.0)
    row = pack([a, same, prefix])
    assert row.input_ids.tolist() == [[5, 6, 7, 8]] and row.segment_offsets.tolist() == [0, 4]
    assert row.pred_index.tolist() == [1, 2, 1, 2, 0, 1]
    assert row.target_ids.tolist() == [7, 8, 7, 8, 6, 7]
    assert row.advantages.tolist() == [1.0, 1.0, -2.0, -2.0, 3.0, 3.0]
    assert row.sample_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert (row.num_forwarded, row.num_unpacked) == (4, 11)


def test_fork_layout_by_hand():
    """Forks at several depths, a leaf extended by a unary chain, a contained sample, a fork at the root token."""
    samples = [
        sample([1, 2, 3, 4]),
        sample([1, 2, 3]),  # contained
        sample([1, 2, 5]),  # fork below [1 2]: node 2 duplicated
        sample([1, 7, 8]),  # fork below [1]: the root token duplicated, a new root segment
        sample([9], group=1),  # another group
        sample([1, 2, 3, 4, 5, 6]),  # extends the leaf [1 2 3 4]
        sample([1, 2, 3, 4, 6]),  # fork below [1 2 3 4]: node 4 duplicated
    ]
    lay = tree_layout(samples)
    assert lay.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 4, 6, 2, 5, 1, 7, 8, 9]
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 1, 2, 0, 1, 2, 0]
    assert lay.segment_offsets.tolist() == [0, 1, 3, 6, 8, 10, 13, 14]
    assert lay.segment_parents.tolist() == [-1, 0, 1, 1, 0, -1, -1]
    assert [p.tolist() for p in lay.sample_positions] == [
        [0, 1, 2, 3],
        [0, 1, 2],
        [0, 8, 9],
        [10, 11, 12],
        [13],
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 6, 7],
    ]


def test_groups_share_a_common_prefix_unless_per_group():
    """By default groups in one row share the prefix their samples have in common, as one group's samples do;
    per group (``share_across_groups=false``) they never share, and with nothing shared inside a group either,
    the row is the sequence-packed one."""
    xs = [[4, 5, 6], [4, 5, 7, 8], [9, 9]]
    samples = [sample(x, trained_from=1, group=g) for g, x in enumerate(xs)]
    tree = pack(samples)
    assert tree.input_ids.tolist() == [[4, 5, 6, 5, 7, 8, 9, 9]]  # [4 5] once, 5 heads each branch
    assert tree.position_ids.tolist() == [[0, 1, 2, 1, 2, 3, 0, 1]]
    assert tree.pred_index.tolist() == [0, 1, 0, 3, 4, 6] and tree.num_forwarded == 8
    per_group = pack(samples, share_across_groups=False)
    seq = SequencePacker(PackingConfig()).pack(samples)
    for name in ("input_ids", "position_ids", "attention_mask", "pred_index", "target_ids", "sample_index"):
        assert torch.equal(getattr(per_group, name), getattr(seq, name)), name
    assert per_group.num_forwarded == per_group.num_unpacked == seq.num_forwarded == 9


def test_shared_system_prompt_is_forwarded_once_per_row():
    """k groups of G rollouts: S-token system prompt, Q-token question, C-token completions (distinct first
    tokens everywhere): the row forwards S - 1 + k Q + k G (C + 1) tokens, one group trie each k (S + Q - 1 +
    G (C + 1)); the planner charges the same."""
    S, Q, C, G, k = 50, 6, 4, 3, 4
    system = np.arange(1000, 1000 + S)
    samples = [
        sample(
            np.concatenate([system, 2000 + 10 * g + np.arange(Q), 3000 + 10 * (G * g + i) + np.arange(C)]),
            S + Q,
            group=g,
        )
        for g in range(k)
        for i in range(G)
    ]
    assert pack(samples).num_forwarded == S - 1 + k * Q + k * G * (C + 1)
    assert pack(samples, share_across_groups=False).num_forwarded == k * (S + Q - 1 + G * (C + 1))
    planner = TreeBudgetPlanner(10_000, 1)
    assert all(planner.add(s) is None for s in samples)
    assert planner.flush().tokens_per_row.tolist() == [S - 1 + k * Q + k * G * (C + 1)]


def test_shared_prompt_counts_once():
    """G rollouts of a P-token prompt: P - 1 shared tokens, then each branch repeats the last prompt token."""
    rng = np.random.default_rng(1)
    prompt, G = rng.integers(0, 100, size=30), 8
    comps = [np.concatenate([[100 + i], rng.integers(0, 100, size=5 + i)]) for i in range(G)]
    row = pack([sample(np.concatenate([prompt, c]), trained_from=30) for c in comps])
    assert row.num_forwarded == 29 + sum(1 + len(c) for c in comps)
    assert row.num_unpacked == sum(30 + len(c) for c in comps)


def test_row_moves_with_its_tree_and_rejects_bad_input():
    row = pack([sample([1, 2, 3], trained_from=1), sample([1, 2, 4], trained_from=1)]).to("meta")
    assert isinstance(row, TreeRow)
    moved = [t for k, t in vars(row).items() if isinstance(t, torch.Tensor) and k != "host_leave"]
    assert all(t.device.type == "meta" for t in moved)
    assert row.host_leave.device.type == "cpu"  # the host copy the hybrid's plan is built from
    assert row.leave.device.type == "meta" and row.num_forwarded == 5  # [1 2] [2 3] [2 4] -> 1 2 3 2 4
    with pytest.raises(ValueError, match="empty row"):
        pack([])
    with pytest.raises(ValueError, match="ids >= 0"):
        pack([sample([1, -2, 3])])
    with pytest.raises(ValueError, match="no predecessor"):
        pack([sample([1, 2], trained_from=0)])


def test_packers_name_their_planners():
    assert planner_for(TreePacker(PackingConfig())) is TreeBudgetPlanner
    assert planner_for(TreePacker(PackingConfig(share_across_groups=False))) is GroupTreeBudgetPlanner
    assert planner_for(SequencePacker(PackingConfig())) is TokenBudgetPlanner
    with pytest.raises(UserError, match="declares no planner"):
        planner_for(object())


# ---------------------------------------------------------------- attention machinery


def test_intervals_and_masks():
    # The worked example's segments; sequence packing = parentless segments = block-diagonal causal.
    leave = token_leave(np.array([0, 2, 5, 8]), np.array([-1, 0, 0]))
    assert leave.tolist() == [8, 8, 5, 5, 5, 8, 8, 8]
    lengths = np.array([3, 1, 2])
    seg = np.repeat(np.arange(3), lengths)
    expected = (seg[:, None] == seg[None, :]) & (np.arange(6)[None, :] <= np.arange(6)[:, None])
    assert dense_mask(sequence_leave(lengths))[0, 0].numpy().tolist() == expected.tolist()
    with pytest.raises(ValueError, match="not contiguous"):
        segment_leave(np.array([0, 1, 2, 3]), np.array([-1, -1, 0]))  # child of 0 after another root
    with pytest.raises(ValueError, match="earlier segment"):
        segment_leave(np.array([0, 1, 2]), np.array([-1, 1]))


def test_flex_mask_mod_equals_dense_mask():
    """The flex BlockMask's mask_mod, evaluated densely on CPU (nothing compiled), is exactly the SDPA mask."""
    from torch.nn.attention.flex_attention import create_mask

    rng = np.random.default_rng(0)
    for _ in range(5):
        row = pack(random_forest(rng, vocab=4))
        n = row.num_forwarded
        for block in (16, 128):
            dense = create_mask(tree_mask_mod(row.leave, block_size=block), None, None, n, n, device="cpu")
            assert torch.equal(dense, row.attention_mask)


# ---------------------------------------------------------------- random tries


def random_forest(rng, vocab: int, num_groups: int = 4, max_samples: int = 6, k: int = 0):
    """Samples of several groups: fresh prompts + completions, forks at random depths (0 = a new root within the
    group), unary extensions, identical copies, prefixes, single-token samples; interleaved across groups."""
    out = []
    for g in range(num_groups):
        prompt = rng.integers(0, vocab, size=rng.integers(1, 8))
        seqs: list[np.ndarray] = []
        for _ in range(rng.integers(1, max_samples + 1)):
            kind = rng.choice(["fresh", "fork", "fork", "extend", "copy", "prefix"]) if seqs else "fresh"
            base = seqs[rng.integers(len(seqs))] if seqs else prompt
            tail = rng.integers(0, vocab, size=rng.integers(1, 7))
            if kind == "fresh":
                ids = np.concatenate([prompt, tail[: rng.integers(0, tail.shape[0] + 1)]])
            elif kind == "fork":
                ids = np.concatenate([base[: rng.integers(0, base.shape[0] + 1)], tail])
            elif kind == "extend":
                ids = np.concatenate([base, tail])
            elif kind == "copy":
                ids = base.copy()
            else:
                ids = base[: rng.integers(1, base.shape[0] + 1)]
            seqs.append(ids)
            start = int(rng.integers(1, ids.shape[0] + 1))
            trained_from = None if start == ids.shape[0] else start
            out.append(sample(ids, trained_from, adv=float(rng.normal()), group=g, k=k, rng=rng))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def brute_force_forwarded(samples, share_across_groups: bool = True) -> int:
    """Σ over trie nodes of max(1, distinct next tokens), with one dict-of-tuples trie per row (or per group)."""
    nexts: dict[tuple, set] = defaultdict(set)
    for s in samples:
        x = tuple(s.input_ids.tolist())
        trie = None if share_across_groups else s.group_id
        for d in range(len(x)):
            nexts[(trie, x[: d + 1])]
            if d + 1 < len(x):
                nexts[(trie, x[: d + 1])].add(x[d + 1])
    return sum(max(1, len(n)) for n in nexts.values())


def path_to(offsets: np.ndarray, parents: np.ndarray, t: int) -> np.ndarray:
    """Packed positions from the root to position ``t``, read off the segment tree alone."""
    s = int(np.searchsorted(offsets, t, side="right")) - 1
    parts = [np.arange(offsets[s], t + 1)]
    s = parents[s]
    while s >= 0:
        parts.append(np.arange(offsets[s], offsets[s + 1]))
        s = parents[s]
    return np.concatenate(parts[::-1])


@pytest.mark.parametrize("share", [True, False], ids=["row_trie", "group_tries"])
@pytest.mark.parametrize("vocab", [3, 50], ids=["dense_forks", "sparse_forks"])
def test_random_layout_properties(vocab, share):
    """Groups' prompts come from the same small vocabularies: one trie per row shares across groups."""
    rng = np.random.default_rng(vocab)
    for _ in range(60):
        samples = random_forest(rng, vocab)
        lay = tree_layout(samples, share)
        row = pack(samples, share)
        offsets, parents, T = lay.segment_offsets, lay.segment_parents, lay.num_tokens
        mask = row.attention_mask[0, 0].numpy()
        # Each sample is its root-to-leaf path: right tokens, depths, and exactly that visibility.
        for s, pos in zip(samples, lay.sample_positions, strict=True):
            assert np.array_equal(path_to(offsets, parents, int(pos[-1])), pos)
            assert np.array_equal(lay.input_ids[pos], s.input_ids)
            assert np.array_equal(lay.position_ids[pos], np.arange(len(s)))
            for d in range(len(s)):
                assert np.array_equal(np.flatnonzero(mask[pos[d]]), pos[: d + 1])
        # Every leaf's path is some sample (no stray tokens); every position lies on some sample's path.
        child_count = np.bincount(parents[parents >= 0], minlength=parents.shape[0])
        rows = {(s.group_id, tuple(s.input_ids.tolist())) for s in samples}
        keys = [tuple(lay.input_ids[path_to(offsets, parents, int(e) - 1)].tolist()) for e in offsets[1:]]
        leaf_paths = {k for k, c in zip(keys, child_count, strict=True) if c == 0}
        assert leaf_paths <= {x for _, x in rows}
        assert np.array_equal(np.unique(np.concatenate(lay.sample_positions)), np.arange(T))
        # A position predicts one next token (why the last shared token is duplicated into each branch).
        nxt: dict[int, set] = defaultdict(set)
        for s, pos in zip(samples, lay.sample_positions, strict=True):
            for d in range(len(s) - 1):
                nxt[int(pos[d])].add(int(s.input_ids[d + 1]))
        assert all(len(v) == 1 for v in nxt.values())
        # Segments are maximal unary chains: they end at a fork (>= 2 child segments) or a leaf.
        assert (child_count != 1).all()
        # Shared prefixes counted once; the planner's trie accounting is exactly what the row forwards.
        assert row.num_forwarded == T == brute_force_forwarded(samples, share)
        assert row.num_unpacked == sum(len(s) for s in samples)
        tries: dict = defaultdict(GroupTrie)
        for s in samples:
            tries[None if share else s.group_id].insert(s.input_ids)
        assert sum(t.num_tokens for t in tries.values()) == T
        assert sum(t.num_pairs for t in tries.values()) == int(mask.sum())
        # Loss terms: predecessor positions in each sample's own path.
        expected = [pos[np.flatnonzero(s.train_mask) - 1] for s, pos in zip(samples, lay.sample_positions)]
        assert row.pred_index.tolist() == np.concatenate(expected).tolist()


# ---------------------------------------------------------------- model equivalence


def unpacked_reference(model, samples, temperature: float):
    """Per-sample stock forwards (full logits): target log-probs, entropies, top-k log-probs of trained tokens."""
    lps, ents, topks = [], [], []
    for s in samples:
        logits = model(input_ids=torch.from_numpy(s.input_ids)[None], use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        t = torch.from_numpy(np.flatnonzero(s.train_mask))
        rows = logp[t - 1]
        lps.append(rows.gather(-1, torch.from_numpy(s.input_ids)[t][:, None]).squeeze(-1))
        ents.append(-(rows.exp() * rows).sum(-1).detach())
        ids = torch.from_numpy(s.token_extras[SAMPLER_TOPK].ids)
        topks.append(rows.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, NEG_INF))
    return torch.cat(lps), torch.cat(ents), torch.cat(topks)


def objective(lps: torch.Tensor, topk: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """A fixed scalar of every log-prob (advantage-weighted, so duplicated positions carry distinct weights)."""
    w = torch.linspace(-1, 1, lps.shape[0]) + adv
    return (w * lps).sum() + torch.where(topk.isfinite(), topk.exp(), 0.0).sum()


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_tree_equals_unpacked(model, samples, temperature: float = 0.7):
    model.train()
    adv = torch.cat([torch.full((s.num_trained,), s.advantage) for s in samples])
    ref_lp, ref_ent, ref_topk = unpacked_reference(model, samples, temperature)
    objective(ref_lp, ref_topk, adv).backward()
    ref_grads = grads(model)

    row = pack(samples)
    assert row.num_forwarded < row.num_unpacked  # something is shared
    stats = token_logprobs(model, row, temperature, with_topk=True)
    torch.testing.assert_close(stats.logprobs, ref_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.entropy, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.topk_logprobs, ref_topk.detach(), atol=1e-5, rtol=1e-5)
    objective(stats.logprobs, stats.topk_logprobs, row.advantages).backward()
    tree_grads = grads(model)
    assert tree_grads.keys() == ref_grads.keys() and len(ref_grads) > 0
    for name, g in ref_grads.items():
        torch.testing.assert_close(tree_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


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


def model_forest(seed: int, vocab: int):
    """Random tries over a small alphabet (so forks share prefixes), top-k of width 3, every row trains."""
    rng = np.random.default_rng(seed)
    while True:
        samples = random_forest(rng, vocab=min(vocab, 6), num_groups=3, max_samples=5, k=3)
        if sum(s.num_trained for s in samples) > 0 and sum(len(s) for s in samples) > brute_force_forwarded(
            samples
        ):
            return samples


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qwen3_tree_equals_unpacked(qwen3, seed):
    assert qwen3.config.tie_word_embeddings
    qwen3.activation_checkpointing_disable()
    assert_tree_equals_unpacked(qwen3, model_forest(seed, qwen3.config.vocab_size))


@pytest.mark.parametrize("seed", [3, 4])
def test_llama_tree_equals_unpacked(llama, seed):
    assert not llama.config.tie_word_embeddings
    assert_tree_equals_unpacked(llama, model_forest(seed, llama.config.vocab_size))


def cross_group_samples(seed: int, vocab: int) -> list[TrainingSequence]:
    """Groups of one row sharing prefixes across groups, interleaved: a 16-token system prompt before group 0's
    and group 1's questions; group 2 shares only its first 7 tokens; group 3's whole prompt is a prefix of
    group 0's; group 4's prompt is identical to group 0's (one completion identical to one of group 0's, so
    two groups' samples end on one leaf); group 5 is multi-turn (trained turns with an untrained tool reply
    between them), its second turn forking inside another sample's first; group 6 shares nothing."""
    rng = np.random.default_rng(seed)

    def toks(n: int) -> np.ndarray:
        return rng.integers(0, vocab, size=n)

    system = toks(16)
    prompts = {
        0: np.concatenate([system, toks(5)]),
        1: np.concatenate([system, toks(3)]),
        2: np.concatenate([system[:7], toks(6)]),
        6: toks(9),
    }
    prompts[3] = prompts[0][:18]
    prompts[4] = prompts[0].copy()
    out, shared_completion = [], toks(6)
    for g, prompt in prompts.items():
        for i in range(3):
            comp = shared_completion if (g in (0, 4) and i == 0) else toks(3 + i)
            ids = np.concatenate([prompt, comp])
            out.append(sample(ids, len(prompt), adv=float(rng.normal()), group=g, k=3, rng=rng))
    turn1, tool = toks(5), toks(4)
    for i in range(3):
        turn2 = toks(4 + i)
        ids = np.concatenate([system, turn1, tool, turn2])
        mask = np.zeros(ids.shape[0], dtype=bool)
        mask[16 : 16 + 5] = True
        mask[25:] = True
        out.append(sample(ids, adv=float(rng.normal()), group=5, k=3, rng=rng, mask=mask))
    out.append(sample(np.concatenate([system, turn1[:3], toks(4)]), 16, adv=0.3, group=5, k=3, rng=rng))
    return [out[i] for i in rng.permutation(len(out))]


@pytest.mark.parametrize("model_name", ["qwen3", "llama"])
def test_cross_group_sharing_equals_unpacked(model_name, request):
    """Rows whose groups share prompt prefixes (a system prompt, part of one, a prompt that is a prefix of
    another's, identical prompts, multi-turn): log-probs, entropies, top-k and gradients equal unpacked forwards,
    and the row forwards fewer tokens than one trie per group."""
    model = request.getfixturevalue(model_name)
    if model_name == "qwen3":
        model.activation_checkpointing_disable()
    samples = cross_group_samples(3, model.config.vocab_size)
    assert pack(samples).num_forwarded < pack(samples, share_across_groups=False).num_forwarded
    assert_tree_equals_unpacked(model, samples)


def test_worked_example_on_qwen3_with_grad_checkpointing(qwen3):
    """A long shared prompt, G forks of it, one sample single-token: the typical GRPO group."""
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, qwen3.config.vocab_size, size=12)
    samples = [
        sample(np.concatenate([prompt, rng.integers(0, 50, size=4 + i)]), 12, adv=i - 1.5, k=3, rng=rng)
        for i in range(4)
    ] + [sample(prompt[:1], None, k=3, rng=rng)]
    qwen3.activation_checkpointing_enable()
    try:
        assert_tree_equals_unpacked(qwen3, samples)
    finally:
        qwen3.activation_checkpointing_disable()


def test_position_ids_alone_are_wrong_for_trees(qwen3):
    """Without the tree mask a branch loses sight of its shared prefix (platform notes): the mask is needed."""
    qwen3.eval()
    samples = model_forest(5, qwen3.config.vocab_size)
    row = pack(samples)
    decoder = qwen3.get_decoder()
    with torch.no_grad():
        masked = decoder(
            input_ids=row.input_ids,
            position_ids=row.position_ids,
            attention_mask=row.attention_mask,
            use_cache=False,
        ).last_hidden_state[0]
        plain = decoder(
            input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False
        ).last_hidden_state[0]
        for s, pos in zip(samples, tree_layout(samples).sample_positions, strict=True):
            alone = decoder(input_ids=torch.from_numpy(s.input_ids)[None], use_cache=False).last_hidden_state[
                0
            ]
            torch.testing.assert_close(masked[torch.from_numpy(pos)], alone, atol=1e-5, rtol=1e-5)
    assert (plain - masked).abs().max() > 1e-2
