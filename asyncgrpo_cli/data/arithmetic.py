"""Built-in dataset: generated one-step addition word problems (offline, seeded), for the SmolLM2 quickstart.

Two numbers from 1 to 10 added, in three wordings (apples, pears, coins, ...): SmolLM2-135M-Instruct solves about a
quarter of them at temperature 0.7, so the rewards of most groups vary and GRPO has signal on the task itself.
Harder problems gave it nothing to learn from (measured, 6 problems x 8 samples each: subtraction 0% correct,
multiplication 10%, two-step problems ~5% overall). Columns: ``prompt`` (chat messages) and ``solution`` (the
exact answer as a string, e.g. ``"12"``), which the ``accuracy`` reward reads.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncgrpo_cli.errors import UserError

if TYPE_CHECKING:
    import datasets

    from asyncgrpo_cli.config.schema import DataConfig

# Keep in sync with asyncgrpo_cli.rewards.format.final_boxed (one \boxed{...}, at the very end). Chosen by measuring
# SmolLM2-135M-Instruct (16 problems x 8 samples, earlier mixed one- and two-step problems): at temperature 0.7 (the
# quickstart's) it kept answers at ~47 tokens; "show your work" wordings gave similar rewards at 2-4x the tokens,
# and at temperature 1.0 the model mostly produces gibberish. On `_buys` below (6 x 8): ~27% correct, ~25% boxed.
ANSWER_INSTRUCTION = (
    "Reply with one short sentence: the calculation, then the answer in \\boxed{}. "
    "Example: 3 + 4 = 7, so the answer is \\boxed{7}."
)
DEFAULT_NUM_EXAMPLES = 2000

_PEOPLE = [
    ("Tom", "He"),
    ("Anna", "She"),
    ("Ben", "He"),
    ("Lucy", "She"),
    ("Sam", "He"),
    ("Mia", "She"),
    ("Leo", "He"),
    ("Emma", "She"),
    ("Max", "He"),
    ("Zoe", "She"),
]
_ITEMS = [
    "apples",
    "pears",
    "oranges",
    "marbles",
    "stickers",
    "pencils",
    "cookies",
    "eggs",
    "shells",
    "cards",
]

Problem = tuple[str, int]


def _buys(r: random.Random, name: str, he: str, item: str) -> Problem:
    a, b = r.randint(1, 10), r.randint(1, 10)
    return f"{name} has {a} {item}. {he} buys {b} more. How many {item} does {name} have now?", a + b


def _together(r: random.Random, name: str, he: str, item: str) -> Problem:
    other = r.choice([p for p, _ in _PEOPLE if p != name])
    a, b = r.randint(1, 10), r.randint(1, 10)
    return f"{name} has {a} {item} and {other} has {b} {item}. How many {item} do they have together?", a + b


def _places(r: random.Random, name: str, he: str, item: str) -> Problem:
    a, b = r.randint(1, 10), r.randint(1, 10)
    return (
        f"There are {a} {item} in a box and {b} {item} on the table. How many {item} are there in all?",
        a + b,
    )


TEMPLATES: list[Callable[[random.Random, str, str, str], Problem]] = [_buys, _together, _places]


def generate_problems(n: int, seed: int) -> list[Problem]:
    """``n`` (question, answer) pairs, deterministic in ``seed``; each template used about equally often."""
    r = random.Random(seed)
    problems = []
    for i in range(n):
        name, he = r.choice(_PEOPLE)
        problems.append(TEMPLATES[i % len(TEMPLATES)](r, name, he, r.choice(_ITEMS)))
    r.shuffle(problems)
    return problems


def build_messages(question: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The conversational prompt of one problem: optional system message, then question + answer instruction."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": f"{question}\n{ANSWER_INSTRUCTION}"})
    return messages


def load_arithmetic(cfg: DataConfig) -> datasets.Dataset:
    """``cfg.num_examples`` (default 2000) problems seeded by ``cfg.seed``: columns ``prompt``, ``solution``."""
    import datasets

    n = DEFAULT_NUM_EXAMPLES if cfg.num_examples is None else cfg.num_examples
    if n <= 0:
        raise UserError(
            f"data.num_examples ({n}) must be positive for data.source=arithmetic; "
            f"leave it unset for {DEFAULT_NUM_EXAMPLES} problems"
        )
    rows = [
        {"prompt": build_messages(q, cfg.system_prompt), "solution": str(a)}
        for q, a in generate_problems(n, cfg.seed)
    ]
    return datasets.Dataset.from_list(rows)


# -- the tools quickstart: calculations a 135M model cannot do in its head, with a calculator ------------------
TOOL_DEMOS = (("What is 12 * 7?", "12 * 7", 84), ("What is 96 + 45?", "96 + 45", 141))
"""Worked examples put before each question: a tool call, its result, the boxed answer. Measured on
SmolLM2-135M-Instruct with the ChatML training template's tools block (4 questions x 8 samples, temperature 1.0):
without an example ~0 replies call a tool; with these two, 9 of 32 wrote a <tool_call> and 8 of 32 the right
argument name. Word problems ("Leo has 16 boxes with 44 cookies...") instead of bare calculations: 0-2 of 32, so
GRPO would have nothing to reinforce; an extra system message lowered the rate too."""


def tool_demo(question: str, expression: str, value: int) -> list[dict[str, str]]:
    call = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'
    )
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": str(value)},
        {"role": "assistant", "content": f"{expression} = {value}, so the answer is \\boxed{{{value}}}."},
    ]


def calculation(r: random.Random, i: int) -> Problem:
    """Alternately a product of two two-digit numbers and a sum of two three-digit ones."""
    if i % 2 == 0:
        a, b = r.randint(11, 99), r.randint(11, 99)
        return f"What is {a} * {b}?", a * b
    a, b = r.randint(100, 999), r.randint(100, 999)
    return f"What is {a} + {b}?", a + b


def load_arithmetic_tools(cfg: DataConfig) -> datasets.Dataset:
    """``num_examples`` (default 2000) calculations seeded by ``cfg.seed``, each prompt led by the worked examples
    of ``TOOL_DEMOS`` (and ``data.system_prompt`` when set); columns ``prompt``, ``solution``. For
    ``rollout.tools=[calculator]``: the ``accuracy`` reward reads the final ``\\boxed{}``."""
    import datasets

    n = DEFAULT_NUM_EXAMPLES if cfg.num_examples is None else cfg.num_examples
    if n <= 0:
        raise UserError(f"data.num_examples ({n}) must be positive for data.source=arithmetic_tools")
    r = random.Random(cfg.seed)
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    demos = [m for demo in TOOL_DEMOS for m in tool_demo(*demo)]
    rows = []
    for i in range(n):
        question, answer = calculation(r, i)
        rows.append(
            {"prompt": [*system, *demos, {"role": "user", "content": question}], "solution": str(answer)}
        )
    return datasets.Dataset.from_list(rows)
