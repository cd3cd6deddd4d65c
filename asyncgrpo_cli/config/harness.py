"""``rollout.harness``: train an agent program that runs its own loop (any language, any OpenAI client). Imports
no torch.

For every rollout the rollout process starts ``command`` once, in its own process group, with the dataset row
as one JSON object on standard input and ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``ASYNCGRPO_MODEL`` pointing
at the recording proxy (``rollout/harness/``). An empty ``command`` (the default) trains without a harness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.config.choices import SamplingMismatch
from asyncgrpo_cli.config.fields import F

PYTHON_ALIASES = ("python", "python3")
"""A command whose first word is one of these runs the rollout process's own interpreter (``sys.executable``)."""


def resolve_command(command: list[str]) -> list[str]:
    """``python`` / ``python3`` as the first word -> this interpreter (``sys.executable``)."""
    import sys

    cmd = [str(c) for c in command]
    if cmd and cmd[0] in PYTHON_ALIASES:
        cmd[0] = sys.executable
    return cmd


@dataclass
class HarnessConfig:
    command: list[str] = F(
        help="The agent program started once per rollout, e.g. [python, my_agent.py] (python / python3 = the "
        "interpreter asyncgrpo runs on; any other first word is looked up on PATH). Reads the row as JSON on "
        'stdin; may print {"reward": <float>} as its last stdout line. Empty: no harness.',
        factory=list,
    )
    timeout: float = F(
        600.0,
        "Seconds one harness process may run; then its process group is stopped and the rollout is unscored "
        "(harness/timeout_count).",
    )
    env: dict[str, Any] = F(
        help="Extra environment variables for the harness (beside OPENAI_BASE_URL, OPENAI_API_KEY, "
        "ASYNCGRPO_MODEL, which it always gets).",
        factory=dict,
    )
    cwd: str | None = F(None, "Working directory of the harness (None: the run's).")
    stop_grace_s: float = F(
        5.0, "Seconds between SIGTERM and SIGKILL when a harness's process group is stopped."
    )

    sampling_mismatch: SamplingMismatch = F(
        "reject",
        "A request whose temperature / top_p / top_k / min_p / repetition_penalty / penalties differ from the "
        "run's sampling.*: reject (HTTP 400 naming the field) or ignore (sampled with the run's settings, "
        "harness/ignored_field_count; for agents that hard-code temperature=0). n, logit_bias, stop, "
        "response_format and tool_choice are always refused.",
    )
    max_consecutive_failures: int = F(
        32,
        "Stop the run when this many harness runs in a row failed (timeout, non-zero exit, bad reward line, late "
        "requests), naming the last failure; 0: never stop (every failed rollout is unscored and counted).",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.command)


def harness_errors(h: HarnessConfig) -> list[str]:
    """Checks of the section alone (``config/checks.py`` adds the cross-section ones)."""
    errors = []
    if not isinstance(h.command, (list, tuple)) or not all(isinstance(c, str) and c for c in h.command):
        errors.append(
            f"rollout.harness.command must be a list of non-empty strings, e.g. [python, my_agent.py]; got "
            f"{h.command!r}."
        )
    if not h.timeout > 0:
        errors.append(f"rollout.harness.timeout must be > 0 seconds, got {h.timeout}.")
    if h.max_consecutive_failures < 0:
        errors.append(
            f"rollout.harness.max_consecutive_failures must be >= 0 (0: never stop), got {h.max_consecutive_failures}."
        )
    if h.stop_grace_s < 0:
        errors.append(f"rollout.harness.stop_grace_s must be >= 0, got {h.stop_grace_s}.")
    return errors
