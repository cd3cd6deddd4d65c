"""Startup checks of agent training, in the trainer process before the rollout process is spawned
(``AsyncRolloutLoop.prepare``): a mistake fails here with the config key, not inside the spawned process.

- every ``rollout.tools`` entry resolves to a module-level, picklable function with a usable schema;
- every ``rollout.environment_factory`` entry resolves to a picklable factory with ``reset``; a mapping needs
  the dataset's ``environment`` column, naming only configured environments;
- something rewards the rollouts: ``rewards.funcs`` or an environment with ``get_reward`` (a harness may print
  its own reward, so ``rollout.harness.command`` only needs its program to exist);
- the chat template: a shipped training template for known families, else a prefix-preservation check that
  warns (or fails with ``rollout.require_prefix_preserving_template=true``).
"""

from __future__ import annotations

import logging
from typing import Any

from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.rollout.agent.environments import ROUTE_COLUMN, load_environments
from asyncgrpo_cli.rollout.agent.templates import choose_chat_template
from asyncgrpo_cli.rollout.agent.tools import check_unique, load_tools

log = logging.getLogger(__name__)


def check_agents(cfg: Any, dataset: Any, tokenizer_path: str) -> str | None:
    """Run the checks; returns the chat template the tool loop renders with (None: the tokenizer's own)."""
    ro = cfg.rollout
    tools = load_tools(list(ro.tools))
    check_unique(tools)
    envs = load_environments(ro.environment_factory)
    envs.check_rows(list(dataset.column_names), lambda: dataset[ROUTE_COLUMN])
    if ro.harness.enabled:
        check_harness_command(list(ro.harness.command), ro.harness.cwd)
    elif not cfg.rewards.funcs and all(k.has_reward is False for k in envs.kinds.values()):
        raise UserError(
            "rewards.funcs is empty and no environment of rollout.environment_factory defines get_reward(): "
            "nothing would score the rollouts; add a reward function or a get_reward method."
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    choice = choose_chat_template(
        tokenizer, dict(cfg.model.chat_template_kwargs), ro.require_prefix_preserving_template
    )
    if choice.problem:
        log.warning(
            "the chat template is not prefix-preserving in tool loops (%s): turns that re-render earlier ones "
            "differently fork into new samples (rollout/fork_frac), costing forward tokens; set "
            "rollout.require_prefix_preserving_template=true to make this an error",
            choice.problem,
        )
    elif choice.family:
        log.info("tool loop: the %s training chat template is swapped in (prefix-preserving)", choice.family)
    names = [t.name for t in tools]
    if ro.harness.enabled:
        log.info("agents: harness %s (timeout %gs)", " ".join(ro.harness.command), ro.harness.timeout)
        return choice.template
    log.info(
        "agents: tools %s; environments %s",
        ", ".join(names) or "none",
        ", ".join(f"{n} ({k.class_name})" for n, k in envs.kinds.items()) or "none",
    )
    return choice.template


def check_harness_command(command: list[str], cwd: str | None) -> None:
    """The harness program exists and is executable (``rollout.harness.command``), ``cwd`` is a directory, and
    the script of ``[python, script.py, ...]`` exists (a missing one would fail every rollout, and the run would
    never train)."""
    import os
    import shutil

    from asyncgrpo_cli.config.harness import PYTHON_ALIASES, resolve_command

    program = resolve_command(command)[0]
    if cwd is not None and not os.path.isdir(cwd):
        raise UserError(f"rollout.harness.cwd {cwd!r} is not a directory.")
    if os.sep in program:  # a path: relative to rollout.harness.cwd when set (the program runs there)
        path = program if os.path.isabs(program) or cwd is None else os.path.join(cwd, program)
        found = os.path.isfile(path) and os.access(path, os.X_OK)
    else:
        found = shutil.which(program) is not None
    if not found:
        raise UserError(
            f"rollout.harness.command: {program!r} is not an executable program (not on PATH, or not executable"
            f"{' from rollout.harness.cwd' if cwd else ''}); give its path, or start the command with python to "
            "run a script with this interpreter."
        )
    if command[0] in PYTHON_ALIASES and len(command) > 1 and not command[1].startswith("-"):
        script = command[1]
        path = script if os.path.isabs(script) or cwd is None else os.path.join(cwd, script)
        if not os.path.isfile(path):
            raise UserError(
                f"rollout.harness.command: the script {script!r} does not exist (looked for {os.path.abspath(path)}"
                f"{', from rollout.harness.cwd' if cwd else ''}); give its path, or run a module with [python, -m, "
                "package.module]."
            )
