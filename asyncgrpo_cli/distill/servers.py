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


def start_teachers(
    cfg: Any,
    servers: list[TeacherServer],
    run_dir: Path,
    stack: ExitStack,
    tokenizer_path: str,
    max_model_len: int | None,
) -> list[TeacherEndpoint]:
    """Start the embedded teachers, probe every teacher (each must score ``max_model_len`` tokens, the student
    server's); their endpoints in teacher-id order."""
    from transformers import AutoTokenizer

    from asyncgrpo_cli.distill.probe import probe_teacher

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    endpoints = []
    for index, t in enumerate(servers):
        url = _start_embedded(cfg, t, run_dir, stack) if t.backend == "embedded" else str(t.base_url)
        report = probe_teacher(
            t.id,
            url,
            tokenizer,
            top_k=cfg.teacher.top_k,
            need_len=max_model_len or 0,
            startup_timeout=cfg.teacher.startup_timeout,
            timeout=cfg.teacher.timeout,
        )
        endpoints.append(TeacherEndpoint(t.id, index, report.url, t.served_model_name or report.model))
    return endpoints


def probe_external_teachers(cfg: Any) -> list[str]:
    """``asyncgrpo check --probe-server``: probe every running teacher (embedded ones are started by the run)."""
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
            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.name_or_path))
        report = probe_teacher(
            t.id,
            str(t.base_url),
            tokenizer,
            top_k=cfg.teacher.top_k,
            need_len=_student_need_len(cfg) or 0,
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
