"""The built-in arithmetic dataset: determinism, columns, size, correct solutions, system prompt."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from asyncgrpo_cli import registry
from asyncgrpo_cli.config.schema import DataConfig
from asyncgrpo_cli.data.arithmetic import ANSWER_INSTRUCTION, DEFAULT_NUM_EXAMPLES, TEMPLATES, load_arithmetic
from asyncgrpo_cli.errors import UserError

N = r"(\d+)"
# An independent solver: one pattern per template, read from the question text, and the answer it implies.
SOLVERS = {
    "buys": (rf"^\w+ has {N} \w+\. \w+ buys {N} more\. How many", lambda a, b: a + b),
    "together": (
        rf"^\w+ has {N} \w+ and \w+ has {N} \w+\. How many \w+ do they have together\?$",
        lambda a, b: a + b,
    ),
    "places": (rf"^There are {N} \w+ in a box and {N} \w+ on the table\. How many", lambda a, b: a + b),
}


def question(row: dict) -> str:
    user = row["prompt"][-1]
    assert user["role"] == "user"
    assert user["content"].endswith("\n" + ANSWER_INSTRUCTION)
    return user["content"][: -len(ANSWER_INSTRUCTION) - 1]


def solve(q: str) -> tuple[str, int | None]:
    matches = [(name, re.search(pattern, q), f) for name, (pattern, f) in SOLVERS.items()]
    hits = [(name, m, f) for name, m, f in matches if m]
    assert len(hits) == 1, f"question matches {len(hits)} templates: {q!r}"
    name, m, f = hits[0]
    return name, f(*map(int, m.groups()))


def test_registered_as_dataset_plugin():
    assert registry.resolve("dataset", "arithmetic") is load_arithmetic


def test_columns_and_types():
    ds = load_arithmetic(DataConfig(num_examples=16))
    assert ds.column_names == ["prompt", "solution"]
    for row in ds:
        assert isinstance(row["solution"], str) and re.fullmatch(r"\d+", row["solution"])
        assert [m["role"] for m in row["prompt"]] == ["user"]
        assert all(isinstance(m["content"], str) for m in row["prompt"])


def test_default_size_and_num_examples():
    assert len(load_arithmetic(DataConfig())) == DEFAULT_NUM_EXAMPLES == 2000
    assert len(load_arithmetic(DataConfig(num_examples=37))) == 37


@pytest.mark.parametrize("n", [0, -3])
def test_rejects_non_positive_size(n):
    with pytest.raises(UserError, match="data.num_examples"):
        load_arithmetic(DataConfig(num_examples=n))


def test_deterministic_by_seed():
    a = load_arithmetic(DataConfig(num_examples=50, seed=3)).to_list()
    assert a == load_arithmetic(DataConfig(num_examples=50, seed=3)).to_list()
    assert a != load_arithmetic(DataConfig(num_examples=50, seed=4)).to_list()


def test_solutions_correct_by_recomputation():
    ds = load_arithmetic(DataConfig(num_examples=402, seed=7))
    seen = Counter()
    for row in ds:
        name, answer = solve(question(row))
        seen[name] += 1
        assert answer is not None and answer >= 0
        assert row["solution"] == str(answer), question(row)
    assert set(seen) == set(SOLVERS) and len(SOLVERS) == len(TEMPLATES)
    assert min(seen.values()) == max(seen.values()) == 402 // len(TEMPLATES)  # templates used equally


def test_problems_are_small_and_varied():
    ds = load_arithmetic(DataConfig(num_examples=400))
    solutions = [int(s) for s in ds["solution"]]
    assert min(solutions) >= 2 and max(solutions) <= 20  # one addition of two numbers from 1 to 10
    assert len(set(solutions)) == 19  # every sum from 2 to 20 occurs
    assert len({question(row) for row in ds}) > 350  # few duplicate questions


def test_system_prompt():
    ds = load_arithmetic(DataConfig(num_examples=5, system_prompt="You are a careful math tutor."))
    for row in ds:
        assert row["prompt"][0] == {"role": "system", "content": "You are a careful math tutor."}
        assert row["prompt"][1]["role"] == "user"
    plain = load_arithmetic(DataConfig(num_examples=5))
    assert [r["prompt"][-1] for r in ds] == [r["prompt"][-1] for r in plain]
    assert all(len(r["prompt"]) == 1 for r in plain)


def test_solutions_are_verified_by_accuracy_reward():
    from asyncgrpo_cli.rewards.accuracy import accuracy_reward

    ds = load_arithmetic(DataConfig(num_examples=8))
    right = [[{"role": "assistant", "content": f"The answer is \\boxed{{{s}}}."}] for s in ds["solution"]]
    wrong = [[{"role": "assistant", "content": f"\\boxed{{{int(s) + 1}}}"}] for s in ds["solution"]]
    assert accuracy_reward(completions=right, solution=ds["solution"]) == [1.0] * 8
    assert accuracy_reward(completions=wrong, solution=ds["solution"]) == [0.0] * 8
