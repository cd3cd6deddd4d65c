"""Accuracy reward: does the completion's final answer equal the ``solution`` column? (math-verify)"""

from __future__ import annotations

import logging
import threading
from typing import Any

from asyncgrpo_cli.rewards.format import completion_text

# Per-call timeout of math-verify's parse/verify. It uses signal.alarm, which only works in the main thread
# (elsewhere math-verify raises ValueError), so reward threads run without it; completions are bounded by
# sampling.max_completion_length, which keeps parsing short.
_MAIN_THREAD_TIMEOUT_S = 5


# Without a timeout, math-verify's parse and verify each warn once per process ("Timeout is disabled as ...
# you must provide the logic for timeout interuption yourself"): the note above is that logic, so those two
# records are dropped. Only they are: other math-verify records and all other loggers pass unchanged.
_TIMEOUT_WARNING = "Timeout is disabled as "


def _drop_timeout_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_TIMEOUT_WARNING)


for _name in ("math_verify.parser", "math_verify.grader"):  # the loggers that emit it (math-verify 0.9)
    logging.getLogger(_name).addFilter(_drop_timeout_warning)  # idempotent: addFilter skips a known filter


def _timeout() -> int | None:
    return _MAIN_THREAD_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def accuracy_reward(completions: list, solution: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's answer equals ``solution`` (math-verify), else 0.0.

    The answer may be a ``\\boxed{...}`` (preferred when present), a plain number, or a sentence such as
    "The answer is 12."; without a box the last number-like expression counts. ``None`` when the solution
    itself cannot be parsed, so the row is excluded from this reward rather than scored 0.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = _timeout()
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    rewards: list[float | None] = []
    for completion, sol in zip(completions, solution, strict=True):
        gold = parse(str(sol), extraction_config=config, parsing_timeout=timeout)
        if not gold:
            rewards.append(None)
            continue
        answer = parse(completion_text(completion), extraction_config=config, parsing_timeout=timeout)
        ok = bool(answer) and verify(gold, answer, timeout_seconds=timeout)
        rewards.append(1.0 if ok else 0.0)
    return rewards
