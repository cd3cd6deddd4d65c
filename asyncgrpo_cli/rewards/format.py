"""Format reward: the completion ends with its final answer in exactly one ``\\boxed{...}``.

The rule matches the answer instruction of the built-in arithmetic dataset
(:data:`asyncgrpo_cli.data.arithmetic.ANSWER_INSTRUCTION`); change both together.
"""

from __future__ import annotations

import re
from typing import Any

BOXED = "\\boxed{"
# What may follow the box: whitespace, sentence punctuation, markdown emphasis, closing math delimiters ($, \], \)).
_TRAILING = re.compile(r"[\s.!?,;:*$)\]\\]*")


def completion_text(completion: Any) -> str:
    """The assistant text of a completion: a message list (conversational) or a plain string."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant")


def final_boxed(text: str) -> str | None:
    """The content of the single ``\\boxed{...}`` that ends ``text``; ``None`` when the format is not met.

    Not met: no box, two or more boxes, unbalanced braces, an empty box, or text other than trailing
    punctuation/whitespace/math delimiters after the box. Nested braces (``\\boxed{\\frac{1}{2}}``) are fine.
    """
    if text.count(BOXED) != 1:
        return None
    start = text.index(BOXED) + len(BOXED)
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                content = text[start:i].strip()
                rest = text[i + 1 :]
                return content if content and _TRAILING.fullmatch(rest) else None
    return None


def format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion gives its final answer in exactly one ``\\boxed{...}`` at the end, else 0.0."""
    return [1.0 if final_boxed(completion_text(c)) is not None else 0.0 for c in completions]
