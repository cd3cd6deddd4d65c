"""The array implementations of planning and packing give exactly what the per-sample Python ones gave.

The reference is the code as it was (``tests/helpers/packing_reference``). On many seeded random steps (GRPO
groups with shared prompts, identical completions, completions that are prefixes of others, dense forks from a
tiny vocabulary, multi-turn train masks, samples with nothing trained, samples longer than the budget, missing
and ragged extras, candidate sets, teacher top-k) both sides plan the same stream and pack every row; every
micro-batch (rows, per-row stats, fillers) and every field of every packed row (values and dtypes, extras
included, in order) must be equal.

The reference has one trie per group. It is matched exactly by ``packing.share_across_groups=false`` on every
step, and by the default (one trie per row) on steps where no two groups share a first token. Rows that do share
across groups are checked against the reference with all their samples in one group when the row has a single
root (then the one-trie-per-group layout of that group is the row's layout), and the vectorized placements
against inserting into one row trie.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.packing.attention import segment_leave
from asyncgrpo_cli.packing.planner import FixedCountPlanner, TokenBudgetPlanner
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.packing.tree import TreePacker
from asyncgrpo_cli.packing.tree_planner import GroupTreeBudgetPlanner, TreeBudgetPlanner
from asyncgrpo_cli.packing.trie import GroupTrie
from asyncgrpo_cli.samples import SAMPLER_TOPK, CandidateSets, TeacherTopK, TopK, TrainingSequence
from tests.helpers.packing_reference import attention as ref_attention
from tests.helpers.packing_reference import planner as ref_planner
from tests.helpers.packing_reference import sequence as ref_sequence
from tests.helpers.packing_reference import tree as ref_tree
from tests.helpers.packing_reference import tree_planner as ref_tree_planner
from tests.helpers.packing_reference import trie as ref_trie


def random_step(
    rng: np.random.Generator,
    n: int,
    *,
    vocab: int,
    prompt: int,
    completion: int,
    extras: bool,
    own_first_token: bool = False,
):
    """``n`` samples in groups of 1-16 (group order sometimes interleaved) with every edge case of the docstring;
    ``own_first_token``: every group's prompt starts with a token no other group uses (no cross-group sharing)."""
    out, group = [], 0
    while len(out) < n:
        g = int(rng.integers(1, 17))
        p = int(rng.integers(1, prompt + 1))
        head = rng.integers(0, vocab, size=p)
        if own_first_token:
            head[0] = vocab + group
        done: list[np.ndarray] = []
        for _ in range(min(g, n - len(out))):
            c = int(rng.integers(0, completion + 1))
            comp = rng.integers(0, vocab, size=c)
            roll = rng.random()
            if done and roll < 0.15:
                comp = done[int(rng.integers(len(done)))].copy()  # identical completion
            elif done and roll < 0.3:
                prev = done[int(rng.integers(len(done)))]
                comp = prev[: int(rng.integers(0, prev.shape[0] + 1))].copy()  # a prefix of another
            elif done and roll < 0.5:
                prev = done[int(rng.integers(len(done)))]
                k = min(c, int(rng.integers(0, prev.shape[0] + 1)))
                comp[:k] = prev[:k]  # a shared stretch, then a fork
            done.append(comp)
            ids = np.concatenate([head, comp]).astype(np.int64)
            out.append(make_sample(rng, ids, p, group, extras))
        group += 1
    if rng.random() < 0.3:  # groups arriving interleaved
        perm = rng.permutation(len(out))
        out = [out[i] for i in perm]
    return out


def make_sample(rng, ids: np.ndarray, p: int, group: int, extras: bool) -> TrainingSequence:
    L = ids.shape[0]
    mask = np.zeros(L, dtype=bool)
    mode = rng.random()
    if mode < 0.7:
        mask[max(1, p) :] = True
    elif mode < 0.85:
        mask[1:] = rng.random(L - 1) < 0.5  # multi-turn: trained stretches with gaps
    n = int(mask.sum())
    token_extras, sets = {}, None
    if extras:
        if rng.random() < 0.7:
            k = int(rng.choice([0, 2, 4]))
            ids_k = rng.integers(-1, 50, size=(n, k))
            token_extras[SAMPLER_TOPK] = TopK(ids_k, rng.normal(-3, 1, size=(n, k)).astype(np.float32))
        if rng.random() < 0.3:
            k = int(rng.integers(1, 4))
            token_extras["teacher_topk"] = TeacherTopK(
                rng.integers(-1, 50, size=(n, k)),
                rng.normal(-3, 1, size=(n, k)).astype(np.float32),
                teacher=rng.integers(0, 2, size=n),
                teacher_names=("a", "b"),
            )
        if rng.random() < 0.3:
            sets = CandidateSets.from_lists(
                [
                    None if rng.random() < 0.3 else rng.integers(0, 50, size=rng.integers(1, 5))
                    for _ in range(n)
                ]
            )
    return TrainingSequence(
        input_ids=ids,
        train_mask=mask,
        sampler_logprobs=(rng.normal(-2, 0.5, size=L) * mask).astype(np.float32),
        advantage=float(rng.normal()),
        sampling_mask=sets,
        token_extras=token_extras,
        rollout_id=f"r{group}-{rng.integers(1 << 30)}",
        group_id=group,
        prompt_seq=group,
    )


def assert_same(a, b, where: str) -> None:
    """Values and dtypes equal, recursively through dataclasses, dicts (in order), lists and tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, where
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif is_dataclass(a):
        assert type(a).__name__ == type(b).__name__, where
        for f in fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a == b, where


def sample_fields(s: TrainingSequence) -> tuple:
    return (s.rollout_id, s.input_ids.tolist(), s.train_mask.tolist(), s.advantage, s.group_id)


def plan_all(planner, samples):
    out = [mb for s in samples if (mb := planner.add(s)) is not None]
    last = planner.flush()
    return out + ([last] if last is not None else []), planner.dropped_oversize_count


def check_step(samples, new_planner, ref_planner_, new_packer, ref_packer) -> int:
    """Plan and pack ``samples`` both ways; return the number of rows compared."""
    new_mbs, new_dropped = plan_all(new_planner, samples)
    ref_mbs, ref_dropped = plan_all(ref_planner_, samples)
    assert new_dropped == ref_dropped and len(new_mbs) == len(ref_mbs)
    rows = 0
    for i, (a, b) in enumerate(zip(new_mbs, ref_mbs, strict=True)):
        for name in ("samples_per_row", "tokens_per_row", "trained_per_row", "attn_cost_per_row"):
            assert_same(getattr(a, name), getattr(b, name), f"micro-batch {i}.{name}")
        assert a.token_budget == b.token_budget and a.filler_ranks == b.filler_ranks
        for r, (ra, rb) in enumerate(zip(a.rows, b.rows, strict=True)):
            assert [sample_fields(s) for s in ra] == [sample_fields(s) for s in rb], f"mb {i} row {r}"
            try:
                want = ref_packer.pack(rb)
            except ValueError as e:  # invalid input: the new packer must refuse it the same way
                with pytest.raises(ValueError, match=str(e)[:40].replace("(", ".").replace(")", ".")):
                    new_packer.pack(ra)
                continue
            assert_same(new_packer.pack(ra), want, f"mb {i} row {r}")
            rows += 1
    return rows


SHAPES = {
    "grpo": dict(vocab=1000, prompt=24, completion=24),
    "dense_forks": dict(vocab=3, prompt=4, completion=8),
    "long": dict(vocab=50, prompt=200, completion=120),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("share", [False, True], ids=["per_group", "no_cross_group_prefix"])
def test_token_budget_planners_and_packers_match_reference(shape, ranks, share):
    """One trie per group: every step. One trie per row (the default): steps without cross-group sharing."""
    rng = np.random.default_rng(10 * list(SHAPES).index(shape) + ranks)
    cfg = PackingConfig(kind="tree", share_across_groups=share)
    planner_cls = TreeBudgetPlanner if share else GroupTreeBudgetPlanner
    compared = 0
    for trial in range(12):
        samples = random_step(
            rng, int(rng.integers(1, 120)), extras=trial % 3 != 2, own_first_token=share, **SHAPES[shape]
        )
        budget = int(rng.choice([8, 64, 300, 4096]))
        compared += check_step(
            samples,
            planner_cls(budget, ranks),
            ref_tree_planner.TreeBudgetPlanner(budget, ranks),
            TreePacker(cfg),
            ref_tree.TreePacker(cfg),
        )
        if share:
            continue  # the sequence side does not depend on it
        compared += check_step(
            samples,
            TokenBudgetPlanner(budget, ranks),
            ref_planner.TokenBudgetPlanner(budget, ranks),
            SequencePacker(cfg),
            ref_sequence.SequencePacker(cfg),
        )
    assert compared > 20


@pytest.mark.parametrize("ranks", [1, 3])
def test_masks_of_another_length_than_their_ids_are_planned_as_the_reference(ranks):
    """A mask one entry shorter or longer than its ids (the packer refuses the row; the planner still counts its
    trained tokens): the kernel reads each mask at its own ends, not at the ids' offsets."""
    rng = np.random.default_rng(31 + ranks)
    for trial in range(8):
        samples = random_step(rng, 60, extras=False, own_first_token=True, **SHAPES["grpo"])
        for i in rng.choice(len(samples), size=12, replace=False):
            s = samples[i]
            mask = s.train_mask[:-1] if rng.random() < 0.5 else np.append(s.train_mask, rng.random() < 0.5)
            samples[i] = replace(s, train_mask=mask)
        budget = int(rng.choice([64, 300]))
        new_mbs, _ = plan_all(TreeBudgetPlanner(budget, ranks), samples)
        ref_mbs, _ = plan_all(ref_tree_planner.TreeBudgetPlanner(budget, ranks), samples)
        assert len(new_mbs) == len(ref_mbs)
        for i, (a, b) in enumerate(zip(new_mbs, ref_mbs, strict=True)):
            for name in ("samples_per_row", "tokens_per_row", "trained_per_row", "attn_cost_per_row"):
                assert_same(getattr(a, name), getattr(b, name), f"trial {trial} micro-batch {i}.{name}")


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_fixed_count_planner_matches_reference(ranks):
    rng = np.random.default_rng(ranks)
    cfg = PackingConfig(kind="tree")
    for _ in range(10):
        samples = random_step(
            rng, int(rng.integers(1, 90)), extras=True, own_first_token=True, **SHAPES["grpo"]
        )
        per_row = int(rng.integers(1, 20))
        for new_packer, ref_packer in (
            (TreePacker(cfg), ref_tree.TreePacker(cfg)),
            (SequencePacker(cfg), ref_sequence.SequencePacker(cfg)),
        ):
            check_step(
                samples,
                FixedCountPlanner(per_row, ranks, 64),
                ref_planner.FixedCountPlanner(per_row, ranks, 64),
                new_packer,
                ref_packer,
            )


def test_flush_without_filler_matches_reference():
    rng = np.random.default_rng(7)
    samples = random_step(rng, 2, extras=True, **SHAPES["grpo"])
    for new, ref in (
        (TreeBudgetPlanner(4096, 4), ref_tree_planner.TreeBudgetPlanner(4096, 4)),
        (TokenBudgetPlanner(4096, 4), ref_planner.TokenBudgetPlanner(4096, 4)),
        (FixedCountPlanner(8, 4, 64), ref_planner.FixedCountPlanner(8, 4, 64)),
    ):
        for s in samples:
            assert new.add(s) is None and ref.add(s) is None
        assert new.flush(allow_filler=False) is None and ref.flush(allow_filler=False) is None
        assert new.num_open_samples == ref.num_open_samples == 2


def att(a) -> tuple:
    return (a.parent, a.own_from, a.length, a.new_tokens, a.new_pairs)


@pytest.mark.parametrize("vocab", [2, 5, 1000])
def test_group_trie_matches_reference(vocab):
    """probe / insert / anchor and the running counts of the trie, sample after sample."""
    rng = np.random.default_rng(vocab)
    for _ in range(40):
        new, ref = GroupTrie(), ref_trie.GroupTrie()
        for s in random_step(
            rng, int(rng.integers(1, 30)), vocab=vocab, prompt=6, completion=10, extras=False
        ):
            ids = s.input_ids
            assert att(new.probe(ids)) == att(ref.probe(ids))
            assert att(new.insert(ids)) == att(ref.insert(ids))
            assert (new.num_tokens, new.num_pairs, len(new)) == (ref.num_tokens, ref.num_pairs, len(ref))
        assert (new.lengths, new.parents, new.own_from) == (ref.lengths, ref.parents, ref.own_from)
        assert [new.anchor(j) for j in range(len(new))] == [ref.anchor(j) for j in range(len(ref))]


def test_segment_leave_matches_reference():
    rng = np.random.default_rng(3)
    for _ in range(200):
        samples = random_step(rng, int(rng.integers(1, 40)), vocab=3, prompt=4, completion=8, extras=False)
        lay = ref_tree.tree_layout(samples)
        offsets, parents = lay.segment_offsets, lay.segment_parents
        assert_same(segment_leave(offsets, parents), ref_attention.segment_leave(offsets, parents), "leave")
    for offsets, parents in (([0, 1, 2, 3], [-1, -1, 0]), ([0, 1, 2], [-1, 1]), ([0, 2, 2], [-1, -1])):
        with pytest.raises(ValueError) as want:
            ref_attention.segment_leave(np.array(offsets), np.array(parents))
        with pytest.raises(ValueError, match=str(want.value)[:30]):
            segment_leave(np.array(offsets), np.array(parents))


def test_bench_planning_workload_matches_reference():
    """The benchmark's own workload (2,000-sample scale, shrunk), through all four cases."""
    from asyncgrpo_cli.bench.planning import Options, make_step

    samples = make_step(Options(samples=400, prompt_len=40, completion_len=24))
    cfg = PackingConfig(kind="tree")
    check_step(
        samples,
        TreeBudgetPlanner(4096, 2),
        ref_tree_planner.TreeBudgetPlanner(4096, 2),
        TreePacker(cfg),
        ref_tree.TreePacker(cfg),
    )
    check_step(
        samples,
        TokenBudgetPlanner(4096, 2),
        ref_planner.TokenBudgetPlanner(4096, 2),
        SequencePacker(cfg),
        ref_sequence.SequencePacker(cfg),
    )


def trie_placements(cat, starts, lengths, trie) -> tuple[np.ndarray, np.ndarray]:
    """(parent, own_from) by inserting each trie's samples into the reference's GroupTrie in row order."""
    tries: dict[int, tuple[ref_trie.GroupTrie, list[int]]] = {}
    parent, own_from = np.empty(len(lengths), np.int64), np.empty(len(lengths), np.int64)
    for i, (g, s, n) in enumerate(zip(trie.tolist(), starts.tolist(), lengths.tolist(), strict=True)):
        t, members = tries.setdefault(g, (ref_trie.GroupTrie(), []))
        att = t.insert(cat[s : s + n])
        parent[i] = members[att.parent] if att.parent >= 0 else -1
        own_from[i] = att.own_from
        members.append(i)
    return parent, own_from


@pytest.mark.parametrize("shape", list(SHAPES))
def test_placements_equal_trie_insertion(shape):
    """A row's placements inserted in one compiled call are the reference tries' own, sample by sample: one trie
    per group, one per row, one per first token, and tries cutting across groups at random; groups interleaved,
    sharing across groups by chance."""
    from asyncgrpo_cli.packing.trie import placements

    rng = np.random.default_rng(20 + list(SHAPES).index(shape))
    for _ in range(60):
        samples = random_step(rng, int(rng.integers(1, 100)), extras=False, **SHAPES[shape])
        ids = [s.input_ids for s in samples]
        lengths = np.array([len(x) for x in ids])
        cat, starts = np.concatenate(ids), np.cumsum(lengths) - lengths
        first: dict = {}
        group = np.array([first.setdefault(s.group_id, len(first)) for s in samples], dtype=np.int64)
        by_token = np.unique(cat[starts], return_inverse=True)[1].reshape(-1).astype(np.int64)
        scattered = np.unique(rng.integers(0, 3, size=len(ids)), return_inverse=True)[1].reshape(-1)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        for trie in (group, np.zeros_like(group), by_token, scattered.astype(np.int64)):
            got, want = placements(cat, offsets, trie), trie_placements(cat, starts, lengths, trie)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def with_system_prompt(samples: list[TrainingSequence], system: np.ndarray) -> list[TrainingSequence]:
    """Each sample with ``system`` (untrained) before its ids: every group's prompt now starts with it."""
    k = system.shape[0]
    return [
        replace(
            s,
            input_ids=np.concatenate([system, s.input_ids]),
            train_mask=np.concatenate([np.zeros(k, bool), s.train_mask]),
            sampler_logprobs=np.concatenate([np.zeros(k, np.float32), s.sampler_logprobs]),
        )
        for s in samples
    ]


def one_group(samples: list[TrainingSequence]) -> list[TrainingSequence]:
    return [replace(s, group_id=-1, prompt_seq=-1) for s in samples]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("ranks", [1, 3])
def test_rows_sharing_across_groups_equal_the_reference_as_one_group(shape, ranks):
    """A system prompt before every group's prompt (1 to 40 tokens; the groups' own prompts then share parts or
    all of theirs by chance on the small vocabularies, some are identical, some a prefix of another's): each
    planned row has one root, and its packed row equals the reference's with the row's samples in one group
    (one trie over the row), field by field. The planner's counts are the packed row's, and each row forwards
    the system prompt's first tokens once, not once per group."""
    rng = np.random.default_rng(100 + 10 * list(SHAPES).index(shape) + ranks)
    packer, ref = TreePacker(PackingConfig()), ref_tree.TreePacker(PackingConfig())
    compared = shared_rows = 0
    for trial in range(10):
        k = int(rng.choice([1, 3, 40]))
        system = rng.integers(0, SHAPES[shape]["vocab"], size=k)
        samples = with_system_prompt(
            random_step(rng, int(rng.integers(1, 120)), extras=trial % 3 != 2, **SHAPES[shape]), system
        )
        budget = int(rng.choice([64, 300, 4096]))
        batches, _ = plan_all(TreeBudgetPlanner(budget, ranks), samples)
        for mb in batches:
            for r, row in enumerate(mb.rows):
                packed = packer.pack(row)
                assert_same(packed, ref.pack(one_group(row)), f"row {r}")
                assert packed.num_forwarded == mb.tokens_per_row[r]
                assert (
                    int((packed.leave - torch.arange(packed.num_forwarded)).sum()) == mb.attn_cost_per_row[r]
                )
                groups = len({(s.group_id, s.prompt_seq) for s in row})
                per_group = TreePacker(PackingConfig(share_across_groups=False)).pack(row)
                assert per_group.num_forwarded - packed.num_forwarded >= (groups - 1) * (k - 1)
                shared_rows += groups > 1
                compared += 1
    assert compared > 20 and shared_rows > 5


def _bad_rows(rng):
    """Rows the packers refuse: (description, samples)."""
    good = random_step(rng, 6, extras=True, vocab=50, prompt=6, completion=6, own_first_token=True)
    s = good[3]
    yield "token 0 trained", [*good[:3], replace(s, train_mask=np.ones(len(s), dtype=bool))]
    negative = s.input_ids.copy()
    negative[-1] = -2
    yield "negative id", [*good[:2], replace(s, input_ids=negative), good[4]]
    empty = dict(input_ids=np.zeros(0, np.int64), train_mask=np.zeros(0, bool), sampler_logprobs=np.zeros(0))
    yield "empty sample", [*good[:2], replace(s, **empty, token_extras={}, sampling_mask=None), good[4]]
    yield "2-D ids", [good[0], replace(s, input_ids=np.zeros((2, 2), np.int64))]
    yield "short extra", [*good[:2], replace(s, token_extras={SAMPLER_TOPK: TopK.empty(s.num_trained + 1)})]
    yield "short sets", [*good[:2], replace(s, sampling_mask=CandidateSets.empty(s.num_trained + 2))]
    names = replace(s, token_extras={"t": TeacherTopK.empty(s.num_trained)})
    other = good[4]
    n = other.num_trained
    other = replace(
        other, token_extras={"t": TeacherTopK(np.zeros((n, 1)), np.zeros((n, 1)), teacher_names=("x",))}
    )
    mixed = replace(good[5], token_extras={"t": TeacherTopK(*(np.zeros((good[5].num_trained, 1)),) * 2)})
    yield "teacher names", [names, other, mixed]


def test_invalid_rows_are_refused_like_the_reference():
    """Each refusal of the reference (a ValueError) names the same sample and problem (the message up to its first
    colon); where the reference failed by accident (an IndexError), the new code refuses with a ValueError."""
    rng = np.random.default_rng(5)
    cfg = PackingConfig(kind="tree")
    for what, samples in _bad_rows(rng):
        for new, ref in (
            (TreePacker(cfg), ref_tree.TreePacker(cfg)),
            (SequencePacker(cfg), ref_sequence.SequencePacker(cfg)),
        ):
            try:
                ref.pack(samples)
            except (ValueError, IndexError) as e:
                want = str(e)
            else:
                want = None
            if want is None:
                assert_same(new.pack(samples), ref.pack(samples), what)
                continue
            with pytest.raises(ValueError) as got:
                new.pack(samples)
            if not want.startswith("index"):
                assert str(got.value).split(":")[0] == want.split(":")[0], (what, str(got.value), want)


def test_bench_planning_prints_every_case(capsys):
    from asyncgrpo_cli.bench.planning import main, parse_options
    from asyncgrpo_cli.errors import UserError

    def plans(out: str) -> list[list[str]]:  # case, micro-batches, rows, forwarded tokens
        return [
            line.split("|")[1:5] for line in out.splitlines() if line.startswith(("| sequence", "| tree"))
        ]

    main(["samples=64", "repeats=1", "token_budget=512"])
    out = capsys.readouterr().out
    assert "64 samples in groups of 16" in out and "as the rollout queue delivers them" in out
    # the same plans from the arrays as built
    main(["samples=64", "repeats=1", "token_budget=512", "transport=plain"])
    plain = capsys.readouterr().out
    assert "built in place" in plain and plans(plain) == plans(out) and len(plans(out)) == 4
    for case in (
        "sequence / token budget",
        "sequence / fixed count",
        "tree / token budget",
        "tree / fixed count",
    ):
        assert f"| {case} |" in out
    main(["samples=32", "repeats=2", "token_budget=512", "host_memory=both"])  # both settings, alternating
    out = capsys.readouterr().out
    for case in ("tree / token budget (kept memory)", "tree / token budget (returned memory)"):
        assert f"| {case} |" in out
    # one add a sample against one add_group a group, alternating: the same plans (the bench checks it too)
    main(["samples=64", "repeats=2", "token_budget=512", "ranks=2", "feed=both"])
    both = capsys.readouterr().out
    fed = {
        feed: [row[1:] for row in plans(both) if f"fed by {feed}" in row[0]] for feed in ("sample", "group")
    }
    assert len(fed["group"]) == 4 and fed["group"] == fed["sample"]
    with pytest.raises(UserError, match="host_memory='x': one of keep, return, both"):
        parse_options(["host_memory=x"])
    with pytest.raises(UserError, match="transport='queue': one of batch, plain"):
        parse_options(["transport=queue"])
    with pytest.raises(UserError, match="KEY in samples, group_size"):
        parse_options(["budget=4"])
    with pytest.raises(UserError, match="repeats='x' is not an integer"):
        parse_options(["repeats=x"])


@pytest.mark.parametrize("kind", ["tree", "sequence"])
def test_bench_scatter_hands_out_both_ways(capsys, kind):
    """Both ways hand out the step; packed rows pickle to fewer bytes than their samples (tree rows forward each
    group's prompt once; sequence rows send their samples' lengths for their positions, intervals, multiplicity)."""
    from asyncgrpo_cli.bench.scatter import main
    from asyncgrpo_cli.errors import UserError

    main(["samples=96", "prompt_len=64", "token_budget=2048", "ranks=2", "rounds=2", f"kind={kind}"])
    out = capsys.readouterr().out
    assert f"96 samples in groups of 16 (P = 64, C = 16, top-k 8), {kind} packing" in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith(("| samples", "| packed"))]
    size = {row[1].strip(): int(row[5]) for row in rows}
    assert set(size) == {"samples", "packed rows"}
    assert size["packed rows"] < size["samples"]
    assert "critical path" in out.splitlines()[-1]
    with pytest.raises(UserError, match="kind tree or sequence"):
        main(["kind=dense"])


@pytest.mark.parametrize("share", [True, False], ids=["row_trie", "group_tries"])
def test_planned_rows_carry_the_placements_the_packer_would_compute(share):
    """A tree planner's rows are PlannedRows whose placements (from its tries) are what the packer computes for
    the same samples as a plain list; packing either gives the same row, field by field, and so does a planned
    row after pickling (the scatter to other ranks). Placements made under other rules, or for other lengths,
    are not used."""
    import pickle

    from asyncgrpo_cli.packing.tree import tree_layout
    from asyncgrpo_cli.packing.trie import PlannedRow

    rng = np.random.default_rng(31 + share)
    packer = TreePacker(PackingConfig(share_across_groups=share))
    planner_cls = TreeBudgetPlanner if share else GroupTreeBudgetPlanner
    planned = 0
    for trial in range(12):
        shape = SHAPES[list(SHAPES)[trial % 3]]
        system = rng.integers(0, shape["vocab"], size=int(rng.choice([0, 1, 12])))
        samples = with_system_prompt(
            random_step(rng, int(rng.integers(1, 120)), extras=False, **shape), system
        )
        batches, _ = plan_all(planner_cls(int(rng.choice([64, 300, 4096])), int(rng.integers(1, 4))), samples)
        for mb in batches:
            for r, row in enumerate(mb.rows):
                if r in mb.filler_ranks:
                    assert type(row) is list
                    continue
                assert isinstance(row, PlannedRow)
                assert row.placements_for(np.array([len(s) for s in row]), not share) is None
                plain = list(row)
                assert_same(tree_layout(row, share), tree_layout(plain, share), f"row {r}")
                assert_same(packer.pack(row), packer.pack(plain), f"row {r}")
                copy = pickle.loads(pickle.dumps(row))
                assert isinstance(copy, PlannedRow) and np.array_equal(copy.own_from, row.own_from)
                assert_same(packer.pack(copy), packer.pack(plain), f"row {r}, pickled")
                planned += 1
    assert planned > 20
    # Placements that do not describe the row (other lengths) are ignored, not trusted.
    a, b = random_step(rng, 2, extras=False, **SHAPES["grpo"])[:2]
    wrong = PlannedRow([a, b], np.array([-1, 0]), np.array([0, 0]), np.array([len(a), len(b) + 1]), share)
    assert_same(tree_layout(wrong, share), tree_layout([a, b], share), "mismatched lengths")
