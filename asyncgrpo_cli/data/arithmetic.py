"""Built-in dataset: generated arithmetic word problems (offline, seeded), for the SmolLM2 quickstart.

One or two operations on small numbers (apples, pears, coins, ...): SmolLM2-135M-Instruct solves some but not all,
so the rewards of a group vary and GRPO has signal. Columns: ``prompt`` (chat messages) and ``solution`` (the
exact answer as a string, e.g. ``"42"``), which the ``accuracy`` reward reads.
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
# SmolLM2-135M-Instruct (16 problems x 8 samples): at temperature 0.7 (the quickstart's) this wording gives ~5%
# accuracy, ~31% format and a reward spread in 94% of groups at ~47 tokens per answer; "show your work" wordings
# gave similar rewards at 2-4x the tokens, and at temperature 1.0 the model mostly produces gibberish.
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
_TOYS = [
    ("ball", "balls"),
    ("kite", "kites"),
    ("robot", "robots"),
    ("puzzle", "puzzles"),
    ("yo-yo", "yo-yos"),
]

Problem = tuple[str, int]


def _add(r: random.Random, name: str, he: str, item: str) -> Problem:
    a, b = r.randint(1, 10), r.randint(1, 10)
    return f"{name} has {a} {item}. {he} buys {b} more. How many {item} does {name} have now?", a + b


def _sub(r: random.Random, name: str, he: str, item: str) -> Problem:
    a = r.randint(3, 15)
    b = r.randint(1, a - 1)
    return (
        f"{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?",
        a - b,
    )


def _mul(r: random.Random, name: str, he: str, item: str) -> Problem:
    a, b = r.randint(2, 5), r.randint(2, 5)
    return f"There are {a} baskets with {b} {item} in each basket. How many {item} are there in total?", a * b


def _div(r: random.Random, name: str, he: str, item: str) -> Problem:
    a, b = r.randint(2, 4), r.randint(2, 5)
    return f"{name} shares {a * b} {item} equally among {a} friends. How many {item} does each friend get?", b


def _add_sub(r: random.Random, name: str, he: str, item: str) -> Problem:
    a, b = r.randint(2, 10), r.randint(1, 10)
    c = r.randint(1, a + b - 1)
    q = f"{name} has {a} {item}. {he} finds {b} more and then loses {c}. How many {item} does {name} have now?"
    return q, a + b - c


def _mul_add(r: random.Random, name: str, he: str, item: str) -> Problem:
    a, b, c = r.randint(2, 4), r.randint(2, 5), r.randint(1, 10)
    q = f"{name} buys {a} bags of {b} {item} and already has {c} {item}. How many {item} does {name} have in total?"
    return q, a * b + c


def _coins(r: random.Random, name: str, he: str, item: str) -> Problem:
    toy, toys = r.choice(_TOYS)
    k, price = r.randint(2, 3), r.randint(2, 5)
    a = k * price + r.randint(0, 10)
    q = f"{name} has {a} coins. One {toy} costs {price} coins. How many coins does {name} have left after buying {k} {toys}?"
    return q, a - k * price


def _share(r: random.Random, name: str, he: str, item: str) -> Problem:
    other = r.choice([p for p, _ in _PEOPLE if p != name])
    a, b = r.randint(1, 10), r.randint(1, 10)
    c = r.randint(1, a + b - 1)
    q = f"{name} has {a} {item} and {other} has {b} {item}. They give away {c} {item}. How many {item} do they have left?"
    return q, a + b - c


TEMPLATES: list[Callable[[random.Random, str, str, str], Problem]] = [
    _add,
    _sub,
    _mul,
    _div,
    _add_sub,
    _mul_add,
    _coins,
    _share,
]


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
