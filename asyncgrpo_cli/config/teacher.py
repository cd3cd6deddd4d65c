"""The teacher servers of a distillation run, from ``teacher.servers``: what each entry may be, and its checks.

An entry maps a teacher id to a server:

- a URL string: a running server (vLLM in production) that the run only talks to, e.g.
  ``teacher.servers={math: 'http://localhost:8001', code: 'http://localhost:8002'}``;
- a mapping ``{backend: vllm, base_url: URL, served_model_name: NAME}``: the same, with the model name to send
  (default: what the server lists first in ``/v1/models``);
- a mapping ``{backend: embedded, model: NAME_OR_PATH}``: the project's embedded server, started by the run as a
  scoring-only teacher (never updated) with ``teacher.embedded``'s settings; for CPU quickstarts and tests.

Ids are sorted: a teacher's index in that order is what ``samples.TeacherTopK.teacher`` stores. Imports no torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.config.schema import TeacherConfig

TEACHER_BACKENDS = ("vllm", "embedded")
_ENTRY_KEYS = ("backend", "base_url", "model", "served_model_name")


@dataclass(frozen=True)
class TeacherServer:
    """One entry of ``teacher.servers``, normalized."""

    id: str
    backend: str
    """``vllm`` (a running server at ``base_url``) or ``embedded`` (started by the run on ``model``)."""
    base_url: str | None = None
    model: str | None = None
    served_model_name: str | None = None

    @property
    def key(self) -> str:
        return f"teacher.servers.{self.id}"

    def describe(self) -> str:
        if self.backend == "embedded":
            return f"embedded teacher started by the run on {self.model}"
        return f"server at {self.base_url}" + (
            f" (model {self.served_model_name})" if self.served_model_name else ""
        )


def _entry(tid: str, value: Any) -> TeacherServer:
    if isinstance(value, str):
        return TeacherServer(tid, "vllm", base_url=value.rstrip("/"))
    if not hasattr(value, "keys"):
        raise ValueError(
            f"teacher.servers.{tid} is {type(value).__name__} {value!r}: give a URL string or "
            "{backend: vllm, base_url: URL} or {backend: embedded, model: NAME_OR_PATH}."
        )
    entry = dict(value)
    for key in entry:
        if key not in _ENTRY_KEYS:
            close = difflib.get_close_matches(str(key), _ENTRY_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (keys: {', '.join(_ENTRY_KEYS)})"
            raise ValueError(f"teacher.servers.{tid}.{key} is not a teacher server setting{hint}")
    backend = str(entry.get("backend") or ("embedded" if entry.get("model") else "vllm"))
    if backend not in TEACHER_BACKENDS:
        raise ValueError(
            f"teacher.servers.{tid}.backend ({backend!r}) must be one of {', '.join(TEACHER_BACKENDS)}."
        )
    url = entry.get("base_url")
    if backend == "vllm" and not url:
        raise ValueError(f"teacher.servers.{tid}: backend vllm needs base_url (e.g. http://localhost:8001).")
    if backend == "embedded" and not entry.get("model"):
        raise ValueError(
            f"teacher.servers.{tid}: backend embedded needs model (a hub id, a local directory or builtin:NAME)."
        )
    return TeacherServer(
        tid,
        backend,
        base_url=str(url).rstrip("/") if url else None,
        model=entry.get("model"),
        served_model_name=entry.get("served_model_name"),
    )


def teacher_servers(cfg: TeacherConfig) -> list[TeacherServer]:
    """The entries of ``teacher.servers`` sorted by id (ValueError naming the key on a malformed entry)."""
    return [_entry(str(tid), cfg.servers[tid]) for tid in sorted(cfg.servers, key=str)]


def teacher_ids(cfg: TeacherConfig) -> tuple[str, ...]:
    return tuple(sorted(str(t) for t in cfg.servers))


def teacher_errors(cfg: TeacherConfig) -> Iterator[str]:
    for tid in sorted(cfg.servers, key=str):
        try:
            t = _entry(str(tid), cfg.servers[tid])
        except ValueError as e:
            yield str(e)
            continue
        if t.base_url is not None and not t.base_url.startswith(("http://", "https://")):
            yield f"{t.key} ({t.base_url!r}) must start with http:// or https://."
    if cfg.top_k < 1:
        yield f"teacher.top_k ({cfg.top_k}) must be >= 1: the teacher reports that many candidates per position."
    if not (cfg.timeout > 0 and cfg.startup_timeout > 0):
        yield "teacher.timeout and teacher.startup_timeout must be > 0 seconds."
    if cfg.max_retries < 0:
        yield "teacher.max_retries must be >= 0."
    if not cfg.id_column:
        yield "teacher.id_column must name a dataset column (default teacher_id)."
