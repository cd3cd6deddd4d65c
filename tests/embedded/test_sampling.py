"""The embedded server's sampling pipeline against hand-computed expectations (vLLM's processed_logprobs)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo_cli.embedded.sampling import (
    BatchParams,
    SamplingParams,
    draw_uniforms,
    processed_logprobs,
    sample,
)

NEG_INF = float("-inf")


def _logprobs(logits: list[float], seen: list[int] | None = None, **kw) -> list[float]:
    """Processed log-probs of one row."""
    t = torch.tensor([logits], dtype=torch.float32)
    params = BatchParams.build([SamplingParams(**kw)], len(logits))
    mask = None
    if seen is not None:
        mask = torch.zeros(1, len(logits), dtype=torch.bool)
        mask[0, seen] = True
    return processed_logprobs(t, params, mask)[0].tolist()


def _log(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def _assert_close(actual: list[float], expected: list[float], tol: float = 1e-5) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        if e == NEG_INF:
            assert a == NEG_INF, (actual, expected)
        else:
            assert a == pytest.approx(e, abs=tol), (actual, expected)


def test_neutral_params_give_plain_log_softmax():
    z = math.exp(1) + math.exp(2) + math.exp(3)
    _assert_close(_logprobs([1.0, 2.0, 3.0]), [1 - math.log(z), 2 - math.log(z), 3 - math.log(z)])


def test_temperature_divides_logits():
    # T = 2: logits [1, 2, 3] -> [0.5, 1, 1.5]
    z = math.exp(0.5) + math.exp(1.0) + math.exp(1.5)
    _assert_close(
        _logprobs([1.0, 2.0, 3.0], temperature=2.0), [0.5 - math.log(z), 1 - math.log(z), 1.5 - math.log(z)]
    )


def test_top_k_keeps_k_largest_and_renormalizes():
    z = math.exp(2) + math.exp(3)
    _assert_close(
        _logprobs([1.0, 2.0, 3.0, 0.0], top_k=2), [NEG_INF, 2 - math.log(z), 3 - math.log(z), NEG_INF]
    )


def test_top_p_drops_the_tail_whose_mass_is_at_most_1_minus_p():
    # probs 0.5/0.3/0.15/0.05, p = 0.75: ascending cumsum 0.05, 0.20 <= 0.25 are dropped; 0.3 and 0.5 survive.
    out = _logprobs(_log([0.5, 0.3, 0.15, 0.05]), top_p=0.75)
    _assert_close(out, _log([0.625, 0.375]) + [NEG_INF, NEG_INF])


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # min_p = 0.2 of the top prob 0.5 -> threshold 0.1: 0.05 is dropped, the rest renormalized over 0.95.
    out = _logprobs(_log([0.5, 0.3, 0.15, 0.05]), min_p=0.2)
    _assert_close(out, _log([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]) + [NEG_INF])


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # seen {0, 1}, penalty 2: [2, -1, 0.5] -> [1, -2, 0.5]
    z = math.exp(1) + math.exp(-2) + math.exp(0.5)
    out = _logprobs([2.0, -1.0, 0.5], seen=[0, 1], repetition_penalty=2.0)
    _assert_close(out, [1 - math.log(z), -2 - math.log(z), 0.5 - math.log(z)])


def test_penalty_applies_before_temperature():
    # penalty 2 then T = 0.5: [2, -1] -> [1, -2] -> [2, -4]
    z = math.exp(2) + math.exp(-4)
    out = _logprobs([2.0, -1.0], seen=[0, 1], repetition_penalty=2.0, temperature=0.5)
    _assert_close(out, [2 - math.log(z), -4 - math.log(z)])


def test_min_p_applies_after_temperature():
    # T = 0.5 sharpens [0.6, 0.3, 0.1] to [0.36, 0.09, 0.01] / 0.46; min_p 0.1 of 0.7826 drops 0.0217
    # (before temperature, 0.1 >= 0.06 would have survived).
    out = _logprobs(_log([0.6, 0.3, 0.1]), temperature=0.5, min_p=0.1)
    _assert_close(out, _log([0.36 / 0.45, 0.09 / 0.45]) + [NEG_INF])


def test_top_p_applies_to_the_top_k_distribution():
    # top_k 3 renormalizes [0.4, 0.3, 0.2] to [4/9, 3/9, 2/9]; p = 0.7 then drops 2/9 <= 0.3 -> [4/7, 3/7].
    out = _logprobs(_log([0.4, 0.3, 0.2, 0.1]), top_k=3, top_p=0.7)
    _assert_close(out, _log([4 / 7, 3 / 7]) + [NEG_INF, NEG_INF])


def test_greedy_is_after_penalties_only_and_takes_the_argmax():
    logits = [2.0, -1.0, 1.5]
    z = math.exp(1) + math.exp(-2) + math.exp(1.5)
    expected = [1 - math.log(z), -2 - math.log(z), 1.5 - math.log(z)]
    # temperature 0 ignores temperature, top_k, top_p and min_p; the penalty still applies
    out = _logprobs(
        logits, seen=[0, 1], temperature=0.0, top_k=1, top_p=0.1, min_p=0.9, repetition_penalty=2.0
    )
    _assert_close(out, expected)
    t = torch.tensor([logits])
    seen = torch.tensor([[True, True, False]])
    params = BatchParams.build([SamplingParams(temperature=0.0, repetition_penalty=2.0)], 3)
    res = sample(t, params, [None], seen=seen, num_top=3)
    assert res.token_ids.tolist() == [2]
    assert res.logprobs.tolist() == pytest.approx([expected[2]], abs=1e-6)


def test_rows_are_independent_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    rows = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6, min_p=0.05),
        SamplingParams(temperature=0.0),
    ]
    batch = processed_logprobs(logits, BatchParams.build(rows, 50))
    for i, p in enumerate(rows):
        alone = processed_logprobs(logits[i : i + 1], BatchParams.build([p], 50))
        assert torch.equal(batch[i : i + 1], alone)


def _seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _draw(seed: int, steps: int = 20) -> list[int]:
    logits = torch.zeros(1, 1000)  # uniform: every draw is decided by the generator alone
    params = BatchParams.build([SamplingParams(temperature=1.0)], 1000)
    g = _seeded(seed)
    return [int(sample(logits, params, [g]).token_ids[0]) for _ in range(steps)]


def test_seeded_sampling_is_deterministic_and_seed_dependent():
    assert _draw(7) == _draw(7)
    assert _draw(7) != _draw(8)


def test_seeded_row_ignores_its_batch_neighbours():
    logits = torch.zeros(3, 1000)
    params = BatchParams.build([SamplingParams()] * 3, 1000)
    shared = _seeded(123)
    alone = sample(logits[:1], BatchParams.build([SamplingParams()], 1000), [_seeded(5)])
    in_batch = sample(logits, params, [None, _seeded(5), None], shared_generator=shared)
    assert int(in_batch.token_ids[1]) == int(alone.token_ids[0])


def test_greedy_rows_draw_nothing_from_their_generator():
    g = _seeded(3)
    state = g.get_state()
    draw_uniforms([g], None, active=[False])
    assert torch.equal(g.get_state(), state)


def test_sampling_frequencies_follow_the_processed_distribution():
    n = 20000
    logits = torch.tensor(_log([0.5, 0.3, 0.15, 0.05])).repeat(n, 1)
    params = BatchParams.build([SamplingParams(top_p=0.75)] * n, 4)  # kept: 0.625 / 0.375
    ids = sample(logits, params, [None] * n, shared_generator=_seeded(0)).token_ids
    counts = torch.bincount(ids, minlength=4).tolist()
    assert counts[2] == counts[3] == 0  # filtered tokens are never drawn
    assert counts[0] / n == pytest.approx(0.625, abs=0.015)


def test_top_n_is_sorted_and_consistent_with_the_sampled_logprob():
    torch.manual_seed(1)
    logits = torch.randn(4, 64)
    params = BatchParams.build([SamplingParams(temperature=0.8, top_k=10)] * 4, 64)
    res = sample(logits, params, [_seeded(i) for i in range(4)], num_top=5)
    full = processed_logprobs(logits, params)
    assert res.top_ids.shape == (4, 5)
    for r in range(4):
        values = res.top_logprobs[r].tolist()
        assert values == sorted(values, reverse=True)
        assert values == full[r, res.top_ids[r]].tolist()
        assert values[0] == full[r].max().item()
        tok = int(res.token_ids[r])
        assert res.logprobs[r].item() == full[r, tok].item()
        assert full[r, tok].item() > NEG_INF  # never a filtered token
