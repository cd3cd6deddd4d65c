"""``asyncgrpo check``: print what a run would do (model, server, world size, budget, rewards, loss), run nothing."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from asyncgrpo_cli import registry
from asyncgrpo_cli.config import lora as lora_policy
from asyncgrpo_cli.config import schema
from asyncgrpo_cli.config.choices import field_choices
from asyncgrpo_cli.config.compile import compile_plan
from asyncgrpo_cli.config.schema import RootConfig


def plan_lines(cfg: RootConfig) -> list[tuple[str, str]]:
    s, tr, ro, sv = cfg.sampling, cfg.trainer, cfg.rollout, cfg.server
    world = int(os.environ.get("WORLD_SIZE", "1"))
    where, mml = registry.resolve("server", sv.backend).plan(sv)  # protocols.ServerBackend.plan
    tb = cfg.packing.token_budget
    if tb is not None and tb <= 0:
        budget_line = (
            f"none (packing.token_budget={tb}): {cfg.packing.samples_per_row} samples per row, Σ L² balanced; "
            f"packing={cfg.packing.kind}"
        )
    else:
        budget = (
            str(tb)
            if tb
            else (
                f"{mml} (the server's max_model_len)"
                if mml
                else "the server's max_model_len (queried at start)"
            )
        )
        budget_line = f"{budget} tokens per row; packing={cfg.packing.kind}"
    if tr.max_steps > 0:
        length = f"{tr.max_steps} optimizer steps (trainer.max_steps)"
    else:
        length = f"{tr.num_train_epochs:g} epoch(s) over the prompts (trainer.num_train_epochs)"
    rows = tr.gradient_accumulation_steps * world
    eps_high = cfg.loss.epsilon_high if cfg.loss.epsilon_high is not None else cfg.loss.epsilon
    return [
        ("recipe", str(cfg.recipe)),
        (
            "model",
            f"{cfg.model.name_or_path} (dtype {cfg.model.dtype}, gradient checkpointing "
            f"{'on' if cfg.model.gradient_checkpointing else 'off'})",
        ),
        ("server", where),
        ("weight sync", f"{sv.weight_sync} every {ro.weight_sync_steps} step(s); one push before generation"),
        *([("lora", lora_line)] if (lora_line := lora_policy.plan_line(cfg)) else []),
        (
            "world size",
            f"{world} trainer process(es); {rows} row(s) per optimizer step "
            f"({tr.gradient_accumulation_steps} micro-batch(es) x {world} rank(s))",
        ),
        ("token budget", budget_line),
        (
            "data",
            f"{cfg.data.source}"
            + (f" {cfg.data.path}" if cfg.data.path else "")
            + f" (prompt column {cfg.data.prompt_column!r})"
            + (f" + {len(cfg.data.mix)} more dataset(s) (data.mix)" if cfg.data.mix else ""),
        ),
        (
            "generation",
            f"G={s.num_generations} per prompt, up to {s.max_completion_length} tokens, T={s.temperature:g}"
            f", top_p={s.top_p:g}, top_k={s.top_k}, min_p={s.min_p:g}"
            + (
                f"; the trainer renormalizes over each token's candidate set where the server returns it "
                f"(sampling_mask={s.sampling_mask}, at most {s.max_mask_candidates} ids per token)"
                if s.truncates and s.sampling_mask != "off"
                else ""
            ),
        ),
        *(
            _distill_lines(cfg)
            if cfg.algorithm == "distill"
            else [_grpo_rewards(cfg), _grpo_loss(cfg, eps_high)]
        ),
        *([_agents_line(cfg)] if ro.has_agents else []),
        *([_harness_line(cfg)] if ro.harness.enabled else []),
        (
            "staleness",
            f"max_staleness={ro.max_staleness}: generation held to {max(ro.max_staleness, 1)} step(s) "
            f"of tokens; staler samples dropped",
        ),
        ("concurrency", f"at most {ro.max_concurrent_rollouts} rollouts in flight"),
        ("optimizer", f"AdamW lr={tr.learning_rate:g} ({tr.lr_scheduler_type}), clip {tr.max_grad_norm:g}"),
        ("compile", compile_plan(tr.compile, tr.device)),
        ("length", length),
        ("checkpoints", f"every {tr.save_steps} steps" if tr.save_steps else "at the end only"),
        ("resume", str(tr.resume)),
        ("metrics", ", ".join(cfg.logging.sinks) + f" every {cfg.logging.logging_steps} step(s)"),
    ]


def _grpo_rewards(cfg: RootConfig) -> tuple[str, str]:
    sources = [str(f) for f in cfg.rewards.funcs]
    if cfg.rollout.environment_factory:
        sources.append("the environments' get_reward()")
    if cfg.rollout.harness.enabled:
        sources.append('the harness\'s last stdout line {"reward": ...}')
    return ("rewards", ", ".join(sources) + " (summed, weight 1)")


def _agents_line(cfg: RootConfig) -> tuple[str, str]:
    ro = cfg.rollout
    env = ro.environment_factory
    if hasattr(env, "keys"):
        envs = (
            "; environments " + ", ".join(f"{k}={v}" for k, v in env.items()) + " (routed by 'environment')"
        )
    else:
        envs = f"; environment {env} (one instance per rollout, reused)" if env else ""
    rounds = (
        "until a reply calls no tool"
        if ro.max_tool_calling_iterations is None
        else (f"at most {ro.max_tool_calling_iterations} tool round(s)")
    )
    return (
        "agents",
        f"tools {', '.join(ro.tools) or 'none'}{envs}; multi-turn, {rounds}, {ro.tool_call_format} tool calls, "
        f"each call at most {ro.tool_timeout_s:g}s; chat template checked for prefix preservation at start "
        f"({'fail' if ro.require_prefix_preserving_template else 'warn'})",
    )


def _harness_line(cfg: RootConfig) -> tuple[str, str]:
    """What runs per rollout under ``rollout.harness``, and which program that is (``cli._check`` then fails
    when it does not exist, as ``train`` would at startup)."""
    import shutil

    from asyncgrpo_cli.config.harness import resolve_command

    h = cfg.rollout.harness
    command = " ".join(h.command)
    program = resolve_command(list(h.command))[0]  # python / python3: this interpreter
    if os.sep not in program:
        program = shutil.which(program) or f"{program!r} (not on PATH)"
    return (
        "harness",
        f"{command} once per rollout (program {program}"
        f"{f', cwd {h.cwd}' if h.cwd else ''}), at most {h.timeout:g}s each, then its process group is stopped "
        f"(SIGTERM, {h.stop_grace_s:g}s, SIGKILL); the row as JSON on stdin, OPENAI_BASE_URL / OPENAI_API_KEY / "
        f"ASYNCGRPO_MODEL point at the recording proxy (loopback)"
        + (f"; env {', '.join(sorted(map(str, h.env)))}" if h.env else "")
        + "; a failed or timed-out harness's rollout is unscored",
    )


def _grpo_loss(cfg: RootConfig, eps_high: float) -> tuple[str, str]:
    return (
        "loss",
        f"{cfg.loss.name}; IS mask [{cfg.loss.vllm_importance_sampling_clip_min:g}, "
        f"{cfg.loss.vllm_importance_sampling_clip_max:g}]; trust region "
        f"[{1 - cfg.loss.epsilon:g}, {1 + eps_high:g}]",
    )


def _distill_lines(cfg: RootConfig) -> list[tuple[str, str]]:
    """The teachers and the divergence of a distillation run."""
    from asyncgrpo_cli.config.teacher import teacher_servers

    lo, te = cfg.loss, cfg.teacher
    servers = teacher_servers(te)
    lines = [(f"teacher {t.id}", t.describe()) for t in servers]
    if len(servers) > 1:
        lines.append(("routing", f"each row by its {te.id_column!r} column (MOPD; never averaged)"))
    if lo.beta == 0:
        kind, support = "forward KL(teacher || student)", f"the teacher's top-{te.top_k} + the sampled token"
    elif lo.beta == 1:
        kind, support = "reverse KL(student || teacher)", "the sampled token"
    else:
        kind, support = f"generalized JSD (beta={lo.beta:g})", "the teacher's top-1 + the sampled token"
    tail = "with the tail bucket" if lo.add_tail_bucket else "renormalized over the support (no tail bucket)"
    lines += [
        (
            "loss",
            f"{lo.name}: {kind} over {support}, {tail}; teacher_temperature={lo.teacher_temperature:g}; "
            f"teacher top_k={te.top_k} per position",
        ),
        (
            "rewards",
            (", ".join(str(f) for f in cfg.rewards.funcs) + " (logged only, not trained on)")
            if cfg.rewards.funcs
            else "none (the teacher is the signal)",
        ),
    ]
    return lines


def explain_group(group: str) -> list[tuple[str, str, str, str]]:
    """(key, default, choices, help) for every field of a group's schema; choices are '' for a free value."""
    from asyncgrpo_cli.config.store import GROUPS

    cls: Any = GROUPS.get(group)
    if cls is None:
        raise KeyError(group)
    return _explain(cls, group)


def _explain(cls: Any, prefix: str) -> list[tuple[str, str, str, str]]:
    out = []
    found = field_choices(cls)
    for f in dataclasses.fields(cls):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else "")
        )
        if dataclasses.is_dataclass(default):
            out += _explain(type(default), f"{prefix}.{f.name}")
            continue
        if isinstance(default, float) and math.isinf(default):
            default = "inf"
        choice = found.get(f.name)
        out.append(
            (
                f"{prefix}.{f.name}",
                repr(default),
                choice.explain() if choice else "",
                f.metadata.get("help", ""),
            )
        )
    return out


__all__ = ["plan_lines", "explain_group", "schema"]
