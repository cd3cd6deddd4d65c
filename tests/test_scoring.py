"""Advantages and the group rules of reference section e, and reward-function handling."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from asyncgrpo_cli.rollout.scoring import (
    RewardError,
    RewardFunction,
    call_reward_funcs,
    group_advantages,
    group_std,
    is_zero_signal,
    load_reward_funcs,
    sum_sources,
)

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
