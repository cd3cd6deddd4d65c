"""TokenBudgetPlanner on plain data: budget, non-empty ranks, Σ L² balancing, oversize drops, flush."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from asyncgrpo_cli.packing.planner import MicroBatch, TokenBudgetPlanner
from asyncgrpo_cli.samples import TrainingSequence


def seq(length: int, trained: int | None = None) -> TrainingSequence:
    trained = length - 1 if trained is None else trained
    mask = np.zeros(length, dtype=bool)
    mask[length - trained :] = True
    return TrainingSequence(
        input_ids=np.arange(length, dtype=np.int64),
        train_mask=mask,
        sampler_logprobs=np.zeros(length, dtype=np.float32),
    )


def run(planner: TokenBudgetPlanner, lengths: list[int]) -> list[MicroBatch]:
    out = [mb for n in lengths if (mb := planner.add(seq(n))) is not None]
    last = planner.flush()
    return out + ([last] if last is not None else [])


def row_lengths(mb: MicroBatch) -> list[list[int]]:
    return [[len(s) for s in row] for row in mb.rows]


def test_equal_loads_balance():
    (mb,) = run(TokenBudgetPlanner(token_budget=100, num_ranks=2), [3, 3, 2, 2])
    assert row_lengths(mb) == [[3, 2], [3, 2]]
    assert mb.attn_cost_per_row.tolist() == [13, 13]
    assert mb.row_imbalance == 1.0


def test_long_sample_alone_vs_short_ones():
    (mb,) = run(TokenBudgetPlanner(token_budget=100, num_ranks=2), [4, 3, 2, 1])
    assert row_lengths(mb) == [[4], [3, 2, 1]]
    assert mb.attn_cost_per_row.tolist() == [16, 14]
    assert mb.row_imbalance == pytest.approx(16 / 15)


def test_smallest_cost_not_fewest_tokens():
    # After [5] | [3, 3] (costs 25 vs 18, tokens 5 vs 6) a new sample goes to the cheaper attention row.
    (mb,) = run(TokenBudgetPlanner(token_budget=100, num_ranks=2), [5, 3, 3, 1])
    assert row_lengths(mb) == [[5], [3, 3, 1]]


def test_dynamic_samples_per_row():
    long = run(TokenBudgetPlanner(token_budget=8, num_ranks=1), [5, 5, 5])
    assert [row_lengths(mb) for mb in long] == [[[5]], [[5]], [[5]]]
    short = run(TokenBudgetPlanner(token_budget=8, num_ranks=1), [2] * 8)
    assert [row_lengths(mb) for mb in short] == [[[2, 2, 2, 2]], [[2, 2, 2, 2]]]
    assert short[0].row_fill_frac.tolist() == [1.0]
    assert long[0].row_fill_frac.tolist() == [5 / 8]


def test_budget_respected_and_no_rank_empty():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=500).tolist()
    planner = TokenBudgetPlanner(token_budget=64, num_ranks=4)
    batches = run(planner, lengths)
    placed = [n for mb in batches for row in row_lengths(mb) for n in row]
    assert sorted(placed) == sorted(lengths)
    for mb in batches:
        assert all(mb.samples_per_row > 0)
        assert all(mb.tokens_per_row <= 64)
        assert mb.tokens_per_row.tolist() == [sum(r) for r in row_lengths(mb)]
        assert mb.samples_per_row.tolist() == [len(r) for r in row_lengths(mb)]
        assert mb.filler_ranks == ()
    # Rows are reasonably full: a micro-batch closes only when a sample fits no row.
    fill = np.concatenate([mb.row_fill_frac for mb in batches[:-1]])
    assert fill.mean() > 0.6


def test_emits_only_when_sample_fits_nowhere():
    planner = TokenBudgetPlanner(token_budget=10, num_ranks=2)
    assert planner.add(seq(6)) is None
    assert planner.add(seq(6)) is None  # empty rank 1 takes it
    assert planner.add(seq(4)) is None  # fits rank 0 (10 tokens)
    assert planner.add(seq(4)) is None  # fits rank 1
    mb = planner.add(seq(1))  # fits neither: closes [[6, 4], [6, 4]], opens a new micro-batch
    assert mb is not None and row_lengths(mb) == [[6, 4], [6, 4]]
    assert planner.num_open_samples == 1


def test_oversize_dropped_and_counted(caplog):
    planner = TokenBudgetPlanner(token_budget=8, num_ranks=1)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo_cli.packing.planner"):
        assert planner.add(seq(9)) is None
        assert planner.add(seq(8)) is None
        assert planner.add(seq(20)) is None
    assert planner.dropped_oversize_count == 2
    assert "packing.token_budget (8)" in caplog.text
    mb = planner.flush()
    assert row_lengths(mb) == [[8]]


def test_stats_trained_tokens():
    planner = TokenBudgetPlanner(token_budget=100, num_ranks=2)
    planner.add(seq(10, trained=4))
    planner.add(seq(6, trained=0))
    mb = planner.flush()
    assert mb.trained_per_row.tolist() == [4, 0]
    assert mb.num_trained == 4


def test_flush_fewer_samples_than_ranks():
    planner = TokenBudgetPlanner(token_budget=100, num_ranks=3)
    planner.add(seq(7))
    planner.add(seq(4))
    assert planner.flush(allow_filler=False) is None  # caller may wait for more
    assert planner.num_open_samples == 2
    mb = planner.flush()
    assert mb.filler_ranks == (2,)
    assert row_lengths(mb) == [[7], [4], [4]]
    filler = mb.rows[2][0]
    assert filler.num_trained == 0 and filler.advantage == 0.0
    assert mb.trained_per_row.tolist() == [6, 3, 0]
    assert planner.num_open_samples == 0
    assert planner.flush() is None


def test_flush_with_enough_samples_fills_every_rank():
    planner = TokenBudgetPlanner(token_budget=100, num_ranks=3)
    for n in [5, 5, 5, 5]:
        planner.add(seq(n))
    mb = planner.flush(allow_filler=False)
    assert mb is not None and mb.filler_ranks == ()
    assert all(mb.samples_per_row > 0)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="token_budget"):
        TokenBudgetPlanner(token_budget=0, num_ranks=1)
    with pytest.raises(ValueError, match="num_ranks"):
        TokenBudgetPlanner(token_budget=8, num_ranks=0)
