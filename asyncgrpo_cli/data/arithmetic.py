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


# -- the tools quickstart: problems a 135M model cannot compute in its head, with a calculator ------------------
TOOLS_SYSTEM_PROMPT = "You are a helpful assistant. Use the calculator for every calculation, then give the answer in \\boxed{}."
TOOL_DEMOS = (
    ("What is 12 * 7?", "12 * 7", 84),
    ("Sam has 96 pens and gets 45 more. How many pens?", "96 + 45", 141),
)
"""Worked examples put before each question: a tool call, its result, the boxed answer. Measured on
SmolLM2-135M-Instruct (4 questions x 8 samples at temperature 1.0): without an example 0 of 64 replies called a
tool, with one 6 of 32, with three 18 of 32; two keep the prompt short."""


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


def _product(r: random.Random, name: str, he: str, item: str) -> Problem:
    a, b = r.randint(11, 99), r.randint(11, 99)
    return f"{name} has {a} boxes with {b} {item} in each. How many {item} are there?", a * b


def _sum(r: random.Random, name: str, he: str, item: str) -> Problem:
    a, b = r.randint(100, 999), r.randint(100, 999)
    return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b


def load_arithmetic_tools(cfg: DataConfig) -> datasets.Dataset:
    """Multiplications of two-digit numbers and sums of three-digit ones (``num_examples``, default 2000), each
    prompt led by a system message and the worked examples of ``TOOL_DEMOS``; columns ``prompt``,
    ``solution``. For ``rollout.tools=[calculator]``: the ``accuracy`` reward reads the final ``\\boxed{}``."""
    import datasets

    n = DEFAULT_NUM_EXAMPLES if cfg.num_examples is None else cfg.num_examples
    if n <= 0:
        raise UserError(f"data.num_examples ({n}) must be positive for data.source=arithmetic_tools")
    r = random.Random(cfg.seed)
    demos = [m for demo in TOOL_DEMOS for m in tool_demo(*demo)]
    rows = []
    for i in range(n):
        name, he = r.choice(_PEOPLE)
        question, answer = (_product, _sum)[i % 2](r, name, he, r.choice(_ITEMS))
        system = [{"role": "system", "content": cfg.system_prompt or TOOLS_SYSTEM_PROMPT}]
        rows.append(
            {"prompt": [*system, *demos, {"role": "user", "content": question}], "solution": str(answer)}
        )
    return datasets.Dataset.from_list(rows)
