"""Startup checks of agent training, in the trainer process before the rollout process is spawned
(``AsyncRolloutLoop.prepare``): a mistake fails here with the config key, not inside the spawned process.

- every ``rollout.tools`` entry resolves to a module-level, picklable function with a usable schema;
- every ``rollout.environment_factory`` entry resolves to a picklable factory with ``reset``; a mapping needs
  the dataset's ``environment`` column, naming only configured environments;
- something rewards the rollouts: ``rewards.funcs`` or an environment with ``get_reward``;
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
    if not cfg.rewards.funcs and all(k.has_reward is False for k in envs.kinds.values()):
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
    log.info(
        "agents: tools %s; environments %s",
        ", ".join(names) or "none",
        ", ".join(f"{n} ({k.class_name})" for n, k in envs.kinds.items()) or "none",
    )
    return choice.template
