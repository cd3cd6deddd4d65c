"""Advantages and the group rules of reference section e (the GRPO scorer), and reward-function handling."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from asyncgrpo_cli import registry
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.rewards import RewardError, RewardFunction, call_reward_funcs, load_reward_funcs
from asyncgrpo_cli.rollout.scorers import Scorer, ScorerContext
from asyncgrpo_cli.rollout.scorers.grpo import (
    ZERO_STD_RTOL,
    GroupScorer,
    group_advantages,
    group_std,
    is_zero_signal,
    sum_sources,
)
from asyncgrpo_cli.samples import RolloutGroup, TrainingSequence

nan = math.nan


def test_advantage_is_group_normalized_with_population_std():
    r = np.array([1.0, 3.0])
    np.testing.assert_allclose(group_advantages(r), [-1.0, 1.0])
    r = np.array([0.0, 0.0, 1.0, 1.0, 1.0])
    mean, std = r.mean(), r.std()
    np.testing.assert_allclose(group_advantages(r), (r - mean) / std)


def test_unscored_completion_gets_zero_and_is_excluded_from_stats():
    r = np.array([1.0, nan, 3.0, 2.0])
    adv = group_advantages(r)
    scored = np.array([1.0, 3.0, 2.0])
    assert adv[1] == 0.0
    np.testing.assert_allclose(adv[[0, 2, 3]], (scored - scored.mean()) / scored.std())


def test_zero_std_and_fewer_than_two_scored_are_dropped():
    assert is_zero_signal(np.array([1.0, 1.0, 1.0]))
    assert is_zero_signal(np.array([0.0, 0.0]))
    assert is_zero_signal(np.array([1.0, nan, nan]))  # one scorable completion
    assert is_zero_signal(np.array([nan, nan]))  # nothing scorable
    assert is_zero_signal(np.array([2.0, nan, 2.0]))  # equal scored rewards
    assert not is_zero_signal(np.array([1.0, nan, 0.0]))
    np.testing.assert_array_equal(group_advantages(np.array([1.0, nan, nan])), [0.0, 0.0, 0.0])


def test_groups_equal_up_to_rounding_have_zero_variance():
    """Rule 4: std <= 1e-6 * max(1, max|r|) is zero variance; exact float equality is not required."""
    fractional = 0.1 + 0.2 + 0.3  # 0.6000000000000001
    assert fractional != 0.6
    for rewards in (
        [fractional, 0.6, 0.6],  # three completions scored by parts summing to 0.6, one scored 0.6 outright
        [0.6, fractional, fractional, 0.6],
        [1.0, 1.0 + 2e-9, 1.0, 1.0],  # gave advantages of +-1.7 with exact equality
        [1000.0, 1000.0 + 1e-4, 1000.0],  # the tolerance follows the reward scale
    ):
        r = np.array(rewards)
        assert is_zero_signal(r), rewards
        np.testing.assert_array_equal(group_advantages(r), np.zeros(len(r)))
    # Real differences, small or at a large scale, keep their signal.
    for rewards in ([0.0, 1e-3], [0.6, 0.6, 0.6 + 1e-4], [1000.0, 1000.1], [nan, 0.1 + 0.2, 0.4]):
        r = np.array(rewards)
        assert not is_zero_signal(r), rewards
        scored = r[~np.isnan(r)]
        np.testing.assert_allclose(group_advantages(r)[~np.isnan(r)], (scored - scored.mean()) / scored.std())
    # The boundary, as stated: at the tolerance the group is dropped, clearly above it kept.
    assert is_zero_signal(np.array([0.0, 1.5 * ZERO_STD_RTOL]))  # std 0.75 * ZERO_STD_RTOL
    assert not is_zero_signal(np.array([0.0, 4 * ZERO_STD_RTOL]))


def test_none_excludes_a_source_and_all_none_is_nan():
    # sources x completions: source 0 scores completions 0,1; source 1 scores 1,2; completion 3 is unscored
    sources = np.array([[1.0, 2.0, nan, nan], [nan, 0.5, 4.0, nan]])
    np.testing.assert_allclose(sum_sources(sources)[:3], [1.0, 2.5, 4.0])
    assert math.isnan(sum_sources(sources)[3])


def test_group_std_over_scored():
    assert group_std(np.array([1.0, 3.0, nan])) == pytest.approx(1.0)
    assert math.isnan(group_std(np.array([nan, nan])))


def _len_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def _format_reward(completions, **kwargs):
    import re

    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, c[0]["content"]) else 0.0 for c in completions]


async def _async_reward(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [1.0 if c[0]["content"] else 0.0 for c in completions]


def _math_only(completions, task, **kwargs):
    return [1.0 if t == "math" else None for t in task]


def _raises(completions, **kwargs):
    raise ValueError("boom")


def _wrong_length(completions, **kwargs):
    return [1.0]


def _run(funcs, kwargs, n, row=7):
    return asyncio.run(
        call_reward_funcs(
            [RewardFunction(f.__name__, f, asyncio.iscoroutinefunction(f)) for f in funcs],
            kwargs,
            n,
            row,
            None,
        )
    )


def test_reference_examples_length_format_async():
    comps = [
        [
            {
                "role": "assistant",
                "content": "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12."
                "</think><answer>(1 + 2) * 4 = 12</answer>",
            }
        ],
        [{"role": "assistant", "content": "The sum of 1 and 2 is 3, which we multiply by 4 to get 12."}],
    ]
    kwargs = {
        "prompts": [[], []],
        "completions": comps,
        "completion_ids": [[6303, 13], [304, 279, 12884, 13]],
    }
    out = _run([_len_reward, _format_reward, _async_reward], kwargs, 2)
    np.testing.assert_allclose(out, [[2.0, 4.0], [1.0, 0.0], [1.0, 1.0]])


def test_multitask_none_rewards():
    kwargs = {
        "prompts": [[], []],
        "completions": [[{"content": "a"}], [{"content": "b"}]],
        "completion_ids": [[1], [2]],
        "task": ["math", "code"],
    }
    out = _run([_math_only], kwargs, 2)
    assert out[0, 0] == 1.0 and math.isnan(out[0, 1])


def test_reward_errors_name_function_and_row():
    kwargs = {"prompts": [[]], "completions": [[{"content": "a"}]], "completion_ids": [[1]]}
    with pytest.raises(RewardError, match=r"'_raises' raised ValueError: boom \(dataset row 7\)"):
        _run([_raises], kwargs, 1)
    kwargs2 = {"prompts": [[], []], "completions": [[{"content": "a"}]] * 2, "completion_ids": [[1], [2]]}
    with pytest.raises(
        RewardError, match=r"'_wrong_length' returned 1 values for dataset row 7; expected a list of 2"
    ):
        _run([_wrong_length], kwargs2, 2)


def test_load_reward_funcs_by_name_path_and_options():
    funcs = load_reward_funcs(
        ["digits", "tests.test_scoring:_len_reward", {"name": "length", "target_length": 8}]
    )
    assert [f.name for f in funcs] == ["digits", "_len_reward", "length"]
    assert funcs[2].fn(completion_ids=[[1] * 8], completions=[[{"content": ""}]]) == [0.0]


def test_unpicklable_reward_is_rejected_with_a_fix():
    import asyncgrpo_cli.registry as registry

    registry.register("reward", "closure_reward_for_test")(lambda completions, **kw: [0.0] * len(completions))
    from asyncgrpo_cli.errors import UserError

    with pytest.raises(UserError, match="cannot be pickled"):
        load_reward_funcs(["closure_reward_for_test"])


# --- the GRPO scorer on a hand-made group: stamping, drop reasons, metrics, the registry ------------------------
def _seq(n: int) -> TrainingSequence:
    return TrainingSequence(
        input_ids=np.arange(n, dtype=np.int64),
        train_mask=np.ones(n, dtype=bool),
        sampler_logprobs=np.zeros(n, dtype=np.float32),
    )


def _group(rollout_rewards, seqs_per_rollout=1) -> RolloutGroup:
    G = len(rollout_rewards)
    return RolloutGroup(
        prompts=[[{"role": "user", "content": "q"}]] * G,
        reward_kwargs={},
        completions=[[{"role": "assistant", "content": "a" * i}] for i in range(G)],
        completions_ids=[[1] * (i + 1) for i in range(G)],
        completions_sequences=[[_seq(4 + i) for _ in range(seqs_per_rollout)] for i in range(G)],
        model_version=3,
        group_id=11,
        row_index=5,
        rollout_rewards=list(rollout_rewards),
        prompt_seq=42,
    )


def _scorer(funcs=()) -> tuple[GroupScorer, MetricWindow]:
    window = MetricWindow()
    rfs = [RewardFunction(f.__name__, f, asyncio.iscoroutinefunction(f)) for f in funcs]
    return GroupScorer(ScorerContext(rfs, window, None, settings=None)), window


def test_group_scorer_stamps_every_sample_and_records_the_reward_metrics():
    scorer, window = _scorer([_len_reward])
    group = _group([None, 1.0, None], seqs_per_rollout=2)  # rewards: 1, 2 + 1, 3
    scored = asyncio.run(scorer.score(group))
    assert scored.drop_reason is None and len(scored.samples) == 6
    np.testing.assert_allclose(group.rewards, [1.0, 3.0, 3.0])
    adv = group_advantages(group.rewards)
    for k, s in enumerate(scored.samples):
        i = k // 2
        assert s.advantage == pytest.approx(adv[i]) and s.reward == group.rewards[i]
        assert (s.group_id, s.prompt_seq, s.model_version, s.group_num_samples) == (11, 42, 3, 6)
        assert s.reward_group_std == pytest.approx(group_std(group.rewards))
        assert s.reward_func_group_std == {"_len_reward": pytest.approx(np.std([1.0, 2.0, 3.0]))}
    out = window.reduce()
    assert out["reward"] == pytest.approx(7 / 3) and out["rewards/_len_reward/mean"] == pytest.approx(2.0)
    assert out["rollout/groups_scored_count"] == 1 and out["rollout/groups_dropped_count"] == 0
    assert out["frac_reward_zero_std"] == 0.0 and "reward_dropped" not in out


def test_group_scorer_drops_a_rounding_equal_group_and_uses_the_advantage_hook():
    scorer, window = _scorer()
    scored = asyncio.run(scorer.score(_group([0.1 + 0.2 + 0.3, 0.6, 0.6])))
    assert scored.samples == [] and scored.drop_reason == "zero_std"
    out = window.reduce()
    assert out["rollout/groups_dropped_count"] == 1 and out["reward_dropped"] == pytest.approx(0.6)
    # A loop's compute_advantages override decides the advantages (not the drop), and its shape is checked.
    scored = asyncio.run(scorer.score(_group([0.0, 1.0]), lambda g: np.array([5.0, -5.0])))
    assert [s.advantage for s in scored.samples] == [5.0, -5.0]
    with pytest.raises(RuntimeError, match=r"compute_advantages returned shape \(3,\); expected \(2,\)"):
        asyncio.run(scorer.score(_group([0.0, 1.0]), lambda g: np.zeros(3)))
    # A kept group whose rollouts left no trained sample queues nothing either.
    empty = _group([0.0, 1.0])
    empty.completions_sequences = [[], []]
    assert asyncio.run(scorer.score(empty)).drop_reason == "no_samples"


def test_the_grpo_scorer_is_registered_and_conforms():
    cls = registry.resolve("scorer", "grpo")
    assert cls is GroupScorer and cls.name == "grpo"
    assert isinstance(_scorer()[0], Scorer)
    assert "grpo" in registry.names("scorer")
    with pytest.raises(UserError, match=r"unknown scorer 'gpro'. Did you mean 'grpo'\?"):
        registry.resolve("scorer", "gpro")


def test_signal_watch_warns_once_per_window_when_nearly_every_group_is_dropped(caplog):
    from asyncgrpo_cli.rollout.scorers.grpo import SignalWatch

    watch = SignalWatch(window=10, frac=0.9)
    with caplog.at_level("WARNING", logger="asyncgrpo_cli.rollout.scorers.grpo"):
        for _ in range(10):
            watch.observe(False, 0.5)  # groups with signal: no warning
        for _ in range(8):
            watch.observe(True, 1.0)
        assert watch.warnings == 0  # 8 of 10 dropped: below 90%
        watch.observe(True, 1.0)
        assert watch.warnings == 1  # 9 of 10
        for _ in range(9):
            watch.observe(True, 1.0)
        assert watch.warnings == 1  # at most once per window of groups
        watch.observe(True, float("nan"))
        assert watch.warnings == 2
    assert "9 of the last 10 groups had rewards without variance" in caplog.text
    assert "Their mean reward is 1 (the best possible" in caplog.text


def test_signal_watch_names_unscored_groups_when_none_was_scored(caplog):
    """Every rollout unscored (a harness that always fails): the warning says so, not 'mean reward undefined'."""
    from asyncgrpo_cli.rollout.scorers.grpo import SignalWatch

    watch = SignalWatch(window=4, frac=0.9)
    with caplog.at_level("WARNING", logger="asyncgrpo_cli.rollout.scorers.grpo"):
        for _ in range(4):
            watch.observe(True, float("nan"))
    assert watch.warnings == 1
    assert "4 of the last 4 groups had no scored rollout" in caplog.text
    assert "a harness that fails every time: harness/*" in caplog.text and "mean reward" not in caplog.text
