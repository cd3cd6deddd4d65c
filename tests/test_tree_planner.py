"""TreeBudgetPlanner on plain data: unique and trained tokens under the budget, group affinity, non-empty ranks,
oversize drops, flush, and row costs equal to what the TreePacker forwards."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest

from asyncgrpo_cli.config.schema import PackingConfig
from asyncgrpo_cli.packing.planner import GroupAdded, MicroBatch, add_each, group_adder
from asyncgrpo_cli.packing.tree import TreePacker
from asyncgrpo_cli.packing.tree_planner import GroupTreeBudgetPlanner, TreeBudgetPlanner
from asyncgrpo_cli.samples import TrainingSequence


def seq(ids, group: int = 0, trained: int | None = None) -> TrainingSequence:
    ids = np.asarray(ids, dtype=np.int64)
    trained = ids.shape[0] - 1 if trained is None else trained
    mask = np.zeros(ids.shape[0], dtype=bool)
    mask[ids.shape[0] - trained :] = True
    return TrainingSequence(
        input_ids=ids,
        train_mask=mask,
        sampler_logprobs=np.zeros(ids.shape[0], dtype=np.float32),
        group_id=group,
        prompt_seq=group,
    )


def rollout(prompt_len: int, completion: int, group: int, branch: int, trained: int | None = None):
    """Group ``group``'s rollout ``branch``: a shared prompt, then a completion unique to the branch."""
    prompt = 1000 * group + np.arange(prompt_len)
    tail = 100_000 + 100 * branch + np.arange(completion)
    return seq(np.concatenate([prompt, tail]), group, completion if trained is None else trained)


def run(planner: TreeBudgetPlanner, samples) -> list[MicroBatch]:
    out = [mb for s in samples if (mb := planner.add(s)) is not None]
    last = planner.flush()
    return out + ([last] if last is not None else [])


def groups_of(mb: MicroBatch) -> list[set[int]]:
    return [{s.group_id for s in row} for row in mb.rows]


def test_budget_counts_shared_prefix_once():
    # 8 rollouts of a 40-token prompt with 5-token completions: 360 raw tokens, 39 + 8 * 6 = 87 unique.
    (mb,) = run(TreeBudgetPlanner(token_budget=90, num_ranks=1), [rollout(40, 5, 0, b) for b in range(8)])
    assert mb.samples_per_row.tolist() == [8]
    assert mb.tokens_per_row.tolist() == [87] and mb.trained_per_row.tolist() == [40]
    row = TreePacker(PackingConfig()).pack(mb.rows[0])
    assert row.num_forwarded == 87 and row.num_unpacked == 360
    assert mb.attn_cost_per_row.tolist() == [int(row.attention_mask.sum())]
    # One token less of budget: the eighth rollout opens a new micro-batch.
    mbs = run(TreeBudgetPlanner(token_budget=86, num_ranks=1), [rollout(40, 5, 0, b) for b in range(8)])
    assert [mb.samples_per_row.tolist() for mb in mbs] == [[7], [1]]
    assert [mb.tokens_per_row.tolist() for mb in mbs] == [[81], [45]]


def test_trained_tokens_bound_rows_of_identical_samples():
    """Identical samples add no forwarded token; the trained-token bound still closes the row."""
    same = [seq(np.arange(10), trained=6) for _ in range(7)]
    mbs = run(TreeBudgetPlanner(token_budget=20, num_ranks=1), same)
    assert [mb.samples_per_row.tolist() for mb in mbs] == [[3], [3], [1]]
    assert [mb.tokens_per_row.tolist() for mb in mbs] == [[10], [10], [10]]
    assert [mb.trained_per_row.tolist() for mb in mbs] == [[18], [18], [6]]


def test_group_affinity_across_ranks():
    # Interleaved groups: each group stays in the row that holds its prompt.
    samples = [rollout(30, 4, g, b) for b in range(4) for g in range(2)]
    (mb,) = run(TreeBudgetPlanner(token_budget=1000, num_ranks=2), samples)
    assert groups_of(mb) == [{0}, {1}]
    assert mb.samples_per_row.tolist() == [4, 4]
    assert mb.tokens_per_row.tolist() == [29 + 4 * 5] * 2


def test_group_spills_to_an_empty_rank():
    planner = TreeBudgetPlanner(token_budget=60, num_ranks=2)
    # Group 0: 40-token prompt; 45 + 6 per further rollout -> 3 rollouts = 57 tokens fill rank 0.
    assert all(planner.add(rollout(40, 5, 0, b)) is None for b in range(3))
    # The home row is full and rank 1 is empty: the fourth rollout goes there (its prompt forwarded again).
    assert planner.add(rollout(40, 5, 0, 3)) is None
    mb = planner.flush()
    assert groups_of(mb) == [{0}, {0}] and mb.tokens_per_row.tolist() == [57, 45] and not mb.filler_ranks


def test_group_closes_the_microbatch_rather_than_overload_a_row():
    planner = TreeBudgetPlanner(token_budget=60, num_ranks=2)
    for b in range(3):  # rank 0: 20 + 16 + 16 = 52 tokens, cost 210 + 200 + 200 = 610 pairs
        planner.add(rollout(5, 15, 0, b))
    planner.add(seq(50_000 + np.arange(30), group=1))  # a new group goes to the cheaper rank 1: cost 465
    # Group 0's home row is full; rank 1 fits 20 more tokens, but its cost would become 675 > 610: close.
    mb = planner.add(rollout(5, 15, 0, 3))
    assert mb is not None and groups_of(mb) == [{0}, {1}] and mb.samples_per_row.tolist() == [3, 1]
    assert mb.attn_cost_per_row.tolist() == [610, 465]
    assert planner.num_open_samples == 1


def test_group_spills_when_it_does_not_raise_the_max_cost():
    planner = TreeBudgetPlanner(token_budget=60, num_ranks=2)
    for b in range(3):
        planner.add(rollout(40, 5, 0, b))  # rank 0: 57 tokens, large attention cost
    planner.add(rollout(3, 1, 1, 0))  # a short new group on rank 1
    # Group 0 rollout: home full; on rank 1 its cost stays below rank 0's, so it goes there.
    assert planner.add(rollout(40, 5, 0, 3)) is None
    mb = planner.flush()
    assert groups_of(mb) == [{0}, {0, 1}] and mb.samples_per_row.tolist() == [3, 2]
    assert mb.attn_cost_per_row[1] <= mb.attn_cost_per_row[0]


def test_new_groups_balance_attention_cost():
    samples = [rollout(20, 5, g, 0) for g in range(4)] + [rollout(2, 1, 9, 0)]
    (mb,) = run(TreeBudgetPlanner(token_budget=1000, num_ranks=2), samples)
    assert groups_of(mb) == [{0, 2, 9}, {1, 3}]
    assert mb.row_imbalance < 1.1


def system_rollout(system: np.ndarray, question: int, completion: int, group: int, branch: int):
    """Group ``group``'s rollout ``branch`` under a shared system prompt: system + a ``question``-token question
    of its own + a completion unique to the branch (distinct first tokens everywhere)."""
    q = 20_000 + 100 * group + np.arange(question)
    tail = 200_000 + 1000 * group + 100 * branch + np.arange(completion)
    return seq(np.concatenate([system, q, tail]), group, completion)


def test_new_group_joins_the_row_that_holds_its_prefix():
    """Rule 3 compares the cost *after* adding: the row whose group shares the newcomer's 40-token system prompt
    wins although it is the more loaded one; with one trie per group the less loaded row wins, as before."""
    system = np.arange(40)
    stream = [system_rollout(system, 5, 5, 0, b) for b in range(2)]  # rank 0: 1275 + 285 = 1560 pairs
    stream.append(seq(60_000 + np.arange(55), group=1))  # rank 1: 1540 pairs
    newcomer = system_rollout(system, 3, 5, 2, 0)  # 48 tokens: 1176 pairs alone, 396 below the system prompt
    for cls, rows, costs in (
        (TreeBudgetPlanner, [{0, 2}, {1}], [1560 + 396, 1540]),
        (GroupTreeBudgetPlanner, [{0}, {1, 2}], [1560, 1540 + 1176]),
    ):
        planner = cls(token_budget=1000, num_ranks=2)
        assert all(planner.add(s) is None for s in [*stream, newcomer])
        mb = planner.flush()
        assert groups_of(mb) == rows and mb.attn_cost_per_row.tolist() == costs
        for r, row in enumerate(mb.rows):
            packed = TreePacker(PackingConfig(share_across_groups=cls.share_across_groups)).pack(row)
            assert packed.num_forwarded == mb.tokens_per_row[r]
            assert int(packed.attention_mask.sum()) == mb.attn_cost_per_row[r]


def test_shared_system_prompt_once_per_row_and_rows_balanced():
    """8 groups of 4 rollouts under one 64-token system prompt on 2 ranks: the groups alternate between the rows
    (balanced), and each row forwards the system prompt once: S - 1 + k Q + k G (C + 1) tokens for its k = 4
    groups, against k (S + Q - 1 + G (C + 1)) with one trie per group."""
    S, Q, C, G, k = 64, 4, 16, 4, 4
    system = np.arange(S)
    stream = [system_rollout(system, Q, C, g, b) for g in range(2 * k) for b in range(G)]
    (mb,) = run(TreeBudgetPlanner(token_budget=4096, num_ranks=2), stream)
    assert groups_of(mb) == [{0, 2, 4, 6}, {1, 3, 5, 7}]
    assert mb.tokens_per_row.tolist() == [S - 1 + k * Q + k * G * (C + 1)] * 2
    (per_group,) = run(GroupTreeBudgetPlanner(token_budget=4096, num_ranks=2), stream)
    assert per_group.tokens_per_row.tolist() == [k * (S + Q - 1 + G * (C + 1))] * 2
    assert mb.attn_cost_per_row.sum() < per_group.attn_cost_per_row.sum()


def test_oversize_dropped_and_counted(caplog):
    planner = TreeBudgetPlanner(token_budget=10, num_ranks=1)
    with caplog.at_level(logging.WARNING):
        assert planner.add(seq(np.arange(11))) is None
    assert planner.dropped_oversize_count == 1 and planner.num_open_samples == 0
    assert "longer than packing.token_budget" in caplog.text
    with pytest.raises(ValueError, match="empty sample"):
        planner.add(seq(np.arange(0), trained=0))
    with pytest.raises(ValueError, match="token_budget"):
        TreeBudgetPlanner(token_budget=0, num_ranks=1)


def test_flush_fills_empty_ranks_or_waits():
    planner = TreeBudgetPlanner(token_budget=100, num_ranks=3)
    planner.add(rollout(5, 3, 0, 0))
    planner.add(rollout(5, 2, 0, 1))  # same group, same row
    assert planner.flush(allow_filler=False) is None and planner.num_open_samples == 2
    mb = planner.flush()
    assert mb.filler_ranks == (1, 2)
    assert mb.samples_per_row.tolist() == [2, 1, 1]
    assert all(not row[0].train_mask.any() and len(row[0]) == 7 for row in mb.rows[1:])
    assert mb.tokens_per_row.tolist() == [4 + 4 + 3, 7, 7] and mb.trained_per_row.tolist() == [5, 0, 0]
    assert planner.flush() is None


def random_stream(rng, num_groups: int, group_size: int, max_prompt: int, max_completion: int):
    """Groups of forking rollouts (some identical, some multi-turn extensions), arriving interleaved."""
    out = []
    for g in range(num_groups):
        prompt = rng.integers(0, 50, size=rng.integers(1, max_prompt + 1))
        prev: list[np.ndarray] = []
        for _ in range(group_size):
            r = rng.random()
            if prev and r < 0.15:
                ids = prev[rng.integers(len(prev))].copy()
            elif prev and r < 0.3:
                ids = np.concatenate(
                    [prev[rng.integers(len(prev))], rng.integers(0, 50, size=rng.integers(1, 5))]
                )
            else:
                ids = np.concatenate([prompt, rng.integers(0, 50, size=rng.integers(1, max_completion + 1))])
            prev.append(ids)
            out.append(seq(ids, g, trained=int(rng.integers(0, ids.shape[0]))))
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("share", [True, False], ids=["row_trie", "group_tries"])
@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_random_streams_keep_every_invariant(num_ranks, share):
    """Prompts over 50 tokens: groups share first tokens and longer stretches across groups by chance."""
    rng = np.random.default_rng(num_ranks)
    packer = TreePacker(PackingConfig(share_across_groups=share))
    for _ in range(15):
        budget = int(rng.integers(30, 200))
        samples = random_stream(rng, num_groups=6, group_size=6, max_prompt=40, max_completion=30)
        planner = (TreeBudgetPlanner if share else GroupTreeBudgetPlanner)(budget, num_ranks)
        mbs = run(planner, samples)
        kept = [s for s in samples if len(s) <= budget]
        assert planner.dropped_oversize_count == len(samples) - len(kept)
        placed = [s for mb in mbs for r, row in enumerate(mb.rows) if r not in mb.filler_ranks for s in row]
        assert sorted(map(id, placed)) == sorted(map(id, kept))  # each kept sample exactly once
        for mb in mbs:
            assert all(len(row) > 0 for row in mb.rows)  # never an empty rank
            assert (mb.tokens_per_row <= budget).all() and (mb.trained_per_row <= budget).all()
            for r, row in enumerate(mb.rows):
                packed = packer.pack(row)
                assert packed.num_forwarded == mb.tokens_per_row[r]
                assert packed.num_trained == mb.trained_per_row[r]
                assert int(packed.attention_mask.sum()) == mb.attn_cost_per_row[r]


def grpo_stream(rng, num_groups: int):
    """Groups arriving in order (now and then interleaved), most sharing a prompt that their samples do not train;
    some with a system prompt common to every group, some whose samples do not start with their first sample's
    prompt (multi-turn), some with a trained token inside the prompt, non-boolean masks now and then."""
    system = rng.integers(0, 40, size=int(rng.choice([0, 0, 6])))
    out = []
    for g in range(num_groups):
        prompt = np.concatenate([system, rng.integers(0, 40, size=int(rng.integers(1, 30)))])
        for _ in range(int(rng.integers(1, 12))):
            head = prompt if rng.random() > 0.1 else rng.integers(0, 40, size=int(rng.integers(1, 30)))
            ids = np.concatenate([head, rng.integers(0, 40, size=int(rng.integers(1, 20)))]).astype(np.int64)
            mask = np.zeros(ids.shape[0], dtype=bool)
            mask[head.shape[0] :] = True
            if rng.random() < 0.1:
                mask[int(rng.integers(1, ids.shape[0]))] = True
            if rng.random() < 0.05:
                mask = mask.astype(np.int8)
            out.append(
                TrainingSequence(
                    input_ids=ids,
                    train_mask=mask,
                    sampler_logprobs=np.zeros(ids.shape[0], np.float32),
                    group_id=g,
                    prompt_seq=g,
                )
            )
    if rng.random() < 0.3:  # a few neighbours swapped: groups interleave
        for i in rng.integers(0, len(out) - 1, size=len(out) // 8):
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def random_case(rng) -> tuple[int, int, list[TrainingSequence]]:
    """(ranks, token budget, samples): 1-8 ranks, tight to roomy budgets, a GRPO-like stream."""
    ranks = int(rng.choice([1, 2, 3, 8]))
    budget = int(rng.choice([60, 150, 400, 2000]))
    return ranks, budget, grpo_stream(rng, int(rng.integers(2, 30)))


@pytest.mark.parametrize("share", [True, False], ids=["row_trie", "group_tries"])
def test_deferred_samples_give_the_micro_batches_of_deciding_each_on_arrival(share, monkeypatch):
    """``add`` defers the samples that cannot close a micro-batch and places them together later. Against the
    same planner deciding every sample as it arrives (nothing deferred), over 1-8 ranks and budgets from tight to
    roomy: the same micro-batches at the same ``add`` calls, rows, per-row stats and placements alike."""
    cls = TreeBudgetPlanner if share else GroupTreeBudgetPlanner
    rng = np.random.default_rng(7 + share)
    deferred = 0
    for _ in range(40):
        ranks, budget, samples = random_case(rng)
        lazy = cls(budget, ranks)
        with monkeypatch.context() as m:
            eager = cls(budget, ranks)
            m.setattr(eager, "_may_wait", lambda *args: False)  # every sample placed on arrival
            want = [(i, mb) for i, s in enumerate(samples) if (mb := eager.add(s)) is not None]
            want_last = eager.flush()
        got = []
        for i, s in enumerate(samples):
            mb = lazy.add(s)
            deferred += len(lazy._waiting) > 0
            if mb is not None:
                got.append((i, mb))
        got_last = lazy.flush()
        assert [i for i, _ in got] == [i for i, _ in want]
        assert_same_batches([mb for _, mb in got] + [got_last], [mb for _, mb in want] + [want_last])
    assert deferred > 500  # the deferral was exercised, not skipped


def assert_same_batches(got: list[MicroBatch | None], want: list[MicroBatch | None]) -> None:
    """The same micro-batches: rows of the same samples, per-row stats and placements alike."""
    for a, b in zip(got, want, strict=True):
        if a is None or b is None:
            assert a is b
            continue
        assert a.filler_ranks == b.filler_ranks
        for name in ("samples_per_row", "tokens_per_row", "trained_per_row", "attn_cost_per_row"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        for r, (ra, rb) in enumerate(zip(a.rows, b.rows, strict=True)):
            if r in a.filler_ranks:  # a context-only copy, made anew by each planner
                assert [s.input_ids.tolist() for s in ra] == [s.input_ids.tolist() for s in rb]
                continue
            assert [id(s) for s in ra] == [id(s) for s in rb]
            if hasattr(rb, "own_from"):
                assert np.array_equal(ra.parents, rb.parents) and np.array_equal(ra.own_from, rb.own_from)


def feed_runs(planner, samples, runs: list[int], single: set[int], group=None) -> tuple[list, list]:
    """Feed ``samples`` in runs of the given lengths as the trainer does (``group``, the rest of a run fed again
    after a closing sample); runs whose index is in ``single`` go through ``add``. Returns the micro-batches (the
    final flush last) and, per call, (taken, dropped)."""
    out, calls, at = [], [], 0
    add_group = group_adder(planner) if group is None else functools.partial(group, planner)
    for k, size in enumerate(runs):
        run_ = samples[at : at + size]
        at += size
        while run_:
            if k in single:
                before = planner.dropped_oversize_count
                mb = planner.add(run_[0])
                added = GroupAdded(mb, 1, [0] if planner.dropped_oversize_count > before else [])
            else:
                added = add_group(run_)
            calls.append((added.taken, added.dropped))
            if added.batch is not None:
                out.append(added.batch)
            run_ = run_[added.taken :]
    return out + [planner.flush()], calls


@pytest.mark.parametrize("min_run", [1, TreeBudgetPlanner.min_group_run], ids=["every_run", "default"])
@pytest.mark.parametrize("share", [True, False], ids=["row_trie", "group_tries"])
def test_a_run_of_samples_at_once_gives_the_micro_batches_of_adding_each(share, min_run, monkeypatch):
    """``add_group`` (one compiled placement of a run, what the trainer calls with a group off the queue) against
    ``add`` a sample: the same micro-batches, closed by the same sample, the same samples taken and dropped; runs
    mixed with single ``add`` calls (deferred samples waiting when a run comes), runs of several groups, oversize
    samples (``add`` a sample then), int32 ids and masks of another length than their ids, over 1-8 ranks and
    tight to roomy budgets."""
    cls = TreeBudgetPlanner if share else GroupTreeBudgetPlanner
    monkeypatch.setattr(cls, "min_group_run", min_run)  # 1: every run through the compiled placement
    rng = np.random.default_rng(11 + share)
    closed_inside = 0
    for trial in range(40):
        ranks, budget, samples = random_case(rng)
        for i in rng.integers(0, len(samples), size=int(rng.integers(0, 4))):
            s, kind = samples[i], rng.random()
            if kind < 0.4:  # longer than the budget
                samples[i] = seq(np.arange(budget + 5), s.group_id, trained=3)
                continue
            ids, mask = s.input_ids, s.train_mask
            if kind < 0.7:
                ids = ids.astype(np.int32)  # converted as add converts them
            else:
                mask = mask[:-1] if rng.random() < 0.5 else np.append(mask, True)  # a mask of another length
            samples[i] = TrainingSequence(
                ids, mask, s.sampler_logprobs, group_id=s.group_id, prompt_seq=s.prompt_seq
            )
        runs, left = [], len(samples)
        while left:
            runs.append(min(left, int(rng.integers(1, 30))))
            left -= runs[-1]
        single = {k for k in range(len(runs)) if rng.random() < 0.2}
        got, got_calls = feed_runs(cls(budget, ranks), samples, runs, single)
        want, want_calls = feed_runs(cls(budget, ranks), samples, runs, single, group=add_each)
        assert got_calls == want_calls, trial
        assert_same_batches(got, want)
        closed_inside += sum(1 for taken, _ in got_calls if taken > 1)
    assert closed_inside > 50  # runs closed micro-batches after their first sample, and went on


def test_planners_without_their_own_add_group_add_a_sample_at_a_time():
    from asyncgrpo_cli.packing.planner import FixedCountPlanner, GroupPlanner, TokenBudgetPlanner

    assert isinstance(TreeBudgetPlanner(10, 1), GroupPlanner)
    for planner in (TokenBudgetPlanner(10, 2), FixedCountPlanner(2, 1, 10)):
        assert not isinstance(planner, GroupPlanner)
        samples = [seq(np.arange(n), 0) for n in (4, 30, 5, 6, 7, 3)]  # 30: oversize for the token budget
        added = group_adder(planner)(samples)
        if isinstance(planner, TokenBudgetPlanner):
            # rows of 4 + 6 and 5 tokens: the 7 closes them, the 3 is not taken
            assert (added.taken, added.dropped) == (5, [1])
            assert [[len(s) for s in row] for row in added.batch.rows] == [[4, 6], [5]]
        else:
            assert (added.taken, added.dropped) == (2, [])  # two samples a micro-batch of one row
            assert [len(s) for s in added.batch.rows[0]] == [30, 4]
