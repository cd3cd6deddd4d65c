"""Built-in rewards: the reference's section l.4 examples, edge cases, picklability, math-verify in a thread."""

from __future__ import annotations

import asyncio
import pickle
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncgrpo_cli import registry
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.rewards.accuracy import accuracy_reward
from asyncgrpo_cli.rewards.format import final_boxed, format_reward
from asyncgrpo_cli.rewards.length import LengthReward, digits_reward


def msgs(*texts: str) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": t}] for t in texts]


# --- the reference's section l.4 examples, through the same call convention ---------------------------------


def test_reference_longer_completions_example():
    def reward_func(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    assert reward_func(completion_ids=[[6303, 13], [304, 279, 12884, 13]], prompts=[[], []]) == [2.0, 4.0]
    # LengthReward is the configurable form: distance to a target length, relative to the target.
    assert LengthReward(target_length=4)(completion_ids=[[6303, 13], [304, 279, 12884, 13]]) == [-0.5, 0.0]


def test_reference_format_example():
    def format_reward_func(completions, **kwargs):
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        return [1.0 if re.match(pattern, c[0]["content"]) else 0.0 for c in completions]

    completions = msgs(
        "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think><answer>(1 + 2) * 4 = 12</answer>",
        "The sum of 1 and 2 is 3, which we multiply by 4 to get 12.",
    )
    assert format_reward_func(completions) == [1.0, 0.0]
    # Our format rule asks for a final \boxed{}: neither completion has one.
    assert format_reward(completions) == [0.0, 0.0]


def test_reference_accuracy_example():
    completions = msgs(r"The answer is \boxed{2}", r"The answer is \boxed{6}")
    assert accuracy_reward(completions=completions, solution=["2", "5"]) == [1.0, 0.0]


def test_reference_multitask_none_excludes_row():
    # A solution that cannot be parsed yields None: the row is left out of this reward, not scored 0.
    completions = msgs(r"\boxed{3}", "def f(): pass")
    assert accuracy_reward(completions=completions, solution=["3", "assert f() is None"]) == [1.0, None]


def test_reference_async_reward_alongside_sync_rewards():
    async def async_reward_func(prompts, completions, **kwargs):
        await asyncio.sleep(0.01)
        return [1.0 if c[0]["content"] else 0.0 for c in completions]

    completions = msgs(r"\boxed{4}", "")
    kwargs = {
        "prompts": [[], []],
        "completions": completions,
        "completion_ids": [[1, 2], []],
        "solution": ["4", "4"],
    }
    assert asyncio.run(async_reward_func(**kwargs)) == [1.0, 0.0]
    assert accuracy_reward(**kwargs) == [1.0, 0.0]
    assert format_reward(**kwargs) == [1.0, 0.0]


# --- accuracy -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, solution, expected",
    [
        ("12", "12", 1.0),
        ("The answer is 12.", "12", 1.0),
        (r"3 + 4 = 7 and 7 + 5 = 12, so the answer is \boxed{12}.", "12", 1.0),
        (r"$\boxed{12}$", "12", 1.0),
        (r"I first thought 13, but the answer is \boxed{12}", "12", 1.0),  # the box wins over other numbers
        ("Tom has 5 apples and buys 7, so he has 12 apples.", "12", 1.0),  # no box: the last number
        (r"\boxed{13}", "12", 0.0),
        (r"\boxed{-3}", "-3", 1.0),
        ("-3", "3", 0.0),
        ("The answer is 2.5", "2.5", 1.0),
        (r"\boxed{\frac{5}{2}}", "2.5", 1.0),
        ("0.5", "1/2", 1.0),
        ("I don't know.", "12", 0.0),
        ("", "12", 0.0),
    ],
)
def test_accuracy_answers(text, solution, expected):
    assert accuracy_reward(completions=msgs(text), solution=[solution]) == [expected]


def test_accuracy_none_when_solution_unparseable():
    assert accuracy_reward(completions=msgs("12", "12"), solution=["", "banana"]) == [None, None]


def test_accuracy_accepts_plain_string_completions():
    assert accuracy_reward(completions=[r"\boxed{7}", "8"], solution=["7", "7"]) == [1.0, 0.0]


def test_accuracy_in_worker_threads():
    """math-verify's signal-based timeout only works in the main thread; ours must score from threads."""
    completions = msgs(r"\boxed{12}", "The answer is 11.", r"\boxed{\frac{1}{2}}")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(accuracy_reward, completions=completions, solution=["12", "12", "0.5"])
            for _ in range(4)
        ]
        results = [f.result(timeout=60) for f in futures]
    assert results == [[1.0, 0.0, 1.0]] * 4


# How the rollout process meets math-verify: rewards resolved by name, scored from a worker thread (no timeout),
# with logging configured to print warnings. Prints the log to stderr.
_SCORE_IN_THREAD = """
import logging, sys, threading
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
{setup}
done = []
def score():
    {score}
    done.append(True)
t = threading.Thread(target=score)
t.start()
t.join(60)
assert done, "scoring in the thread failed or timed out"
"""


def _stderr_of(setup: str, score: str) -> str:
    code = textwrap.dedent(_SCORE_IN_THREAD).format(setup=setup, score=score)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_math_verify_timeout_warnings_are_silenced_on_the_reward_path():
    setup = (
        "from asyncgrpo_cli.rollout.rewards import load_reward_funcs\nfuncs = load_reward_funcs(['accuracy'])"
    )
    score = (
        "assert funcs[0].fn(completions=[r'\\boxed{{3}}'], solution=['3']) == [1.0]; "
        "logging.getLogger('math_verify.parser').warning('another math-verify warning')"
    )
    err = _stderr_of(setup, score)
    assert "Timeout is disabled" not in err
    assert "math_verify.parser: another math-verify warning" in err  # only that message is dropped


def test_math_verify_still_warns_without_our_filter():
    """The control: math-verify alone prints both warnings from a thread, so the test above is not vacuous."""
    setup = "from math_verify import parse, verify"
    score = "verify(parse('3', parsing_timeout=None), parse('3', parsing_timeout=None), timeout_seconds=None)"
    err = _stderr_of(setup, score)
    assert err.count("Timeout is disabled") == 2, err


# --- format ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, content",
    [
        (r"\boxed{12}", "12"),
        (r"5 + 7 = 12. The answer is \boxed{12}.", "12"),
        ("The answer is \\boxed{12}!  \n", "12"),
        (r"$\boxed{-3}$", "-3"),
        (r"\[ \boxed{2.5} \]", "2.5"),
        (r"**\boxed{12}**", "12"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{ 7 }", "7"),
    ],
)
def test_format_accepts(text, content):
    assert final_boxed(text) == content
    assert format_reward(msgs(text)) == [1.0]


@pytest.mark.parametrize(
    "text",
    [
        "12",
        "",
        r"\boxed{}",
        r"\boxed{  }",
        r"\boxed{12} apples",  # text after the box
        r"\boxed{12} because 5 + 7 = 12.",
        r"\boxed{5} then \boxed{12}",  # two boxes
        r"\boxed{\frac{1}{2}",  # unbalanced
        r"\boxed 12",
    ],
)
def test_format_rejects(text):
    assert final_boxed(text) is None
    assert format_reward(msgs(text)) == [0.0]


def test_format_rule_matches_arithmetic_instruction():
    """The example answer the arithmetic prompts show must itself earn the format and accuracy rewards."""
    from asyncgrpo_cli.data.arithmetic import ANSWER_INSTRUCTION

    assert r"the answer in \boxed{}" in ANSWER_INSTRUCTION
    example = ANSWER_INSTRUCTION.split("Example: ", 1)[1]
    assert final_boxed(example) == "7"
    assert accuracy_reward(completions=msgs(example), solution=["7"]) == [1.0]


# --- length and digits ----------------------------------------------------------------------------------------


def test_length_reward_values():
    reward = LengthReward(target_length=64)
    assert reward(completion_ids=[[0] * 64, [0] * 32, [0] * 128, [], [0] * 96]) == [
        0.0,
        -0.5,
        -1.0,
        -1.0,
        -0.5,
    ]
    assert LengthReward()(completion_ids=[[1] * 64]) == [0.0]


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "64"])
def test_length_reward_rejects_bad_target(bad):
    with pytest.raises(UserError, match="target_length"):
        LengthReward(target_length=bad)


def test_digits_reward():
    assert digits_reward(completions=msgs("1234", "ab12", "", "no digits", "١٢")) == [1.0, 0.5, 0.0, 0.0, 0.0]


# --- plumbing: picklable (they run in a spawned process), reachable through the registry -------------------


@pytest.mark.parametrize("name", ["accuracy", "format", "digits"])
def test_registered_functions_pickle(name):
    func = registry.resolve("reward", name)
    assert pickle.loads(pickle.dumps(func)) is func


def test_length_reward_pickles_with_its_options():
    cls = registry.resolve("reward", "length")
    restored = pickle.loads(pickle.dumps(cls(target_length=10)))
    assert restored.target_length == 10
    assert restored(completion_ids=[[1] * 5]) == [-0.5]
    assert restored.__name__ == "length_reward"
