"""Starting and checking a distillation run's teachers (trainer process, rank 0, before the rollout spawn).

Embedded teachers (``teacher.servers.<id>: {backend: embedded, model: ...}``) are started here as scoring-only
servers (they are never sent weights) with ``teacher.embedded``'s settings, their logs in
``RUN_DIR/teacher_<id>.log``, and stopped by PID through the run's ``ExitStack``. Every teacher, started here or
external, then passes the teacher probe (``distill/probe.py``) before a single rollout is generated.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo_cli.config.teacher import TeacherServer, teacher_servers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TeacherEndpoint:
    """A teacher the rollout process scores with (picklable): its id, its index in the sorted ids, where it is
    and the model name to send."""

    id: str
    index: int
    base_url: str
    model: str


def _student_need_len(cfg: Any) -> int | None:
    """The longest sequence a teacher must score: the student server's max_model_len when the config states it."""
    from asyncgrpo_cli import registry

    _, mml = registry.resolve("server", cfg.server.backend).plan(cfg.server)
    return mml


def _start_embedded(cfg: Any, t: TeacherServer, run_dir: Path, stack: ExitStack) -> str:
    from asyncgrpo_cli.model.resolve import resolve_model_path
    from asyncgrpo_cli.server.launch import EmbeddedServerProcess

    proc = EmbeddedServerProcess(
        resolve_model_path(str(t.model)),
        cfg.teacher.embedded,
        served_model_name=t.served_model_name,
        log_path=Path(run_dir) / f"teacher_{t.id}.log",
        startup_timeout=cfg.teacher.startup_timeout,
    )
    stack.callback(proc.stop)
    proc.start()
    log.info("teacher %r: embedded server on %s serving %s", t.id, proc.base_url, t.model)
    return proc.base_url


LONGEST_PROMPTS_RENDERED = 32
"""Prompts (the longest by characters) rendered to find the longest prompt in tokens."""


def longest_sequence(cfg: Any, dataset: Any, tokenizer: Any, max_model_len: int) -> int:
    """The longest sequence a teacher may be asked to score: the longest prompt (in tokens, through the chat
    template; measured on the ``LONGEST_PROMPTS_RENDERED`` longest by characters) plus
    ``sampling.max_completion_length``, at most the student server's ``max_model_len``."""
    prompts = dataset["prompt"]
    sizes = sorted(
        range(len(prompts)), key=lambda i: -sum(len(str(m.get("content", ""))) for m in prompts[i])
    )
    longest = 0
    for i in sizes[:LONGEST_PROMPTS_RENDERED]:
        out = tokenizer.apply_chat_template(
            prompts[i], add_generation_prompt=True, tokenize=True, **dict(cfg.model.chat_template_kwargs)
        )
        longest = max(longest, len(out["input_ids"] if hasattr(out, "keys") else out))
    return min(longest + cfg.sampling.max_completion_length, max_model_len)


def start_teachers(
    cfg: Any,
    servers: list[TeacherServer],
    run_dir: Path,
    stack: ExitStack,
    tokenizer_path: str,
    dataset: Any,
    max_model_len: int,
) -> list[TeacherEndpoint]:
    """Start the embedded teachers, probe every teacher (each must score the longest sequence the student can
    produce, ``longest_sequence``); their endpoints in teacher-id order."""
    from transformers import AutoTokenizer

    from asyncgrpo_cli.distill.probe import probe_teacher

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    need_len = longest_sequence(cfg, dataset, tokenizer, max_model_len)
    endpoints = []
    for index, t in enumerate(servers):
        url = _start_embedded(cfg, t, run_dir, stack) if t.backend == "embedded" else str(t.base_url)
        report = probe_teacher(
            t.id,
            url,
            tokenizer,
            top_k=cfg.teacher.top_k,
            need_len=need_len,
            startup_timeout=cfg.teacher.startup_timeout,
            timeout=cfg.teacher.timeout,
        )
        endpoints.append(TeacherEndpoint(t.id, index, report.url, t.served_model_name or report.model))
    return endpoints


def probe_external_teachers(cfg: Any) -> list[str]:
    """``asyncgrpo check --probe-server``: probe every running teacher (embedded ones are started by the run),
    for the longest prompt of the data plus ``sampling.max_completion_length``."""
    from transformers import AutoTokenizer

    from asyncgrpo_cli.distill.probe import probe_teacher
    from asyncgrpo_cli.model.resolve import resolve_model_path

    tokenizer = None
    lines = []
    for t in teacher_servers(cfg.teacher):
        if t.backend == "embedded":
            lines.append(f"teacher {t.id!r}: {t.describe()}; nothing to probe")
            continue
        if tokenizer is None:
            from asyncgrpo_cli.data.sources import load_prompts

            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.name_or_path))
            cap = _student_need_len(cfg) or 1 << 30  # the student server's max_model_len when the config says
            need_len = longest_sequence(cfg, load_prompts(cfg.data), tokenizer, cap)
        report = probe_teacher(
            t.id,
            str(t.base_url),
            tokenizer,
            top_k=cfg.teacher.top_k,
            need_len=need_len,
            startup_timeout=cfg.teacher.startup_timeout,
            timeout=cfg.teacher.timeout,
        )
        lines.append(
            f"teacher {t.id!r} at {report.url}: model {report.model!r}, max_model_len {report.max_model_len}, "
            f"vLLM {report.version or '-'}, max_logprobs "
            f"{'not reported' if report.max_logprobs is None else report.max_logprobs}, logprobs mode "
            f"{report.logprobs_mode or '?'}: the student's tokenizer, every capability the run needs"
        )
    return lines
