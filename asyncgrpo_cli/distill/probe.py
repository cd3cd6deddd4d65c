"""The teacher startup probe: can this teacher server score the student's sequences? Asked before generation
(``distill``) and by ``asyncgrpo check --probe-server``; it changes nothing on the server.

``probe_teacher`` runs, for one ``teacher.servers`` entry:

1. ready within ``teacher.startup_timeout`` (``ServerControl.wait_ready``), then what it says about itself
   (``server/report.py::read_server``: ``/v1/models``, ``/server_info`` when dev mode is on, ``/version``);
2. ``max_model_len >= need_len + 1``: a scoring request sends the student's whole sequence (up to ``need_len``
   tokens, the student's max_model_len) and asks for one generated token, which vLLM and the embedded server both
   need room for;
3. ``--max-logprobs`` (-1 = no cap) ``>= teacher.top_k``, from ``/server_info``; a teacher without dev mode does
   not report it, and then the first scoring request asks ``prompt_logprobs=top_k`` and must not get a 400;
4. the student's tokenizer: a probe text (digits, punctuation, non-ASCII, the chat template's special tokens) is
   tokenized by the student and scored; every id the teacher reports (the realized tokens and its candidates)
   must decode, in its ``decoded_token``, to what the student's tokenizer decodes it to as vLLM does
   (``embedded/prompt_logprobs.py::_decoded``: ``decode([id])`` with SentencePiece leading spaces restored).
   Byte fragments (a decode ending in U+FFFD) are skipped: vLLM re-decodes them with up to 4 tokens of context,
   and another vocabulary shows on the whole tokens anyway. Then the student's largest id (``len(tokenizer) -
   1``) is sent: a 400 means a smaller teacher vocabulary. Candidate ids beyond the student's vocabulary mean a
   larger one. A teacher with another vocabulary trains the student toward wrong tokens, silently as long as
   its vocabulary is not larger than the student's (reference section 8), so this check refuses it.

``--logprobs-mode`` is only reported: prompt tokens never go through the sampler, so prompt log-probs are the raw
T=1 values in every mode (vllm-rl-api.md section 3); ``processed_logprobs`` changes nothing for a teacher.

Every gap becomes one ``UserError`` naming the teacher id, its URL, the config key and, for a vLLM teacher, the
``vllm serve`` command that fixes them all (``vllm serve MODEL --port 8001 --max-logprobs -1``).
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from typing import Any

import httpx

from asyncgrpo_cli.distill.teacher import ROUTE, refusal_fix, scoring_payload
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.rollout.client import _error_message
from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.server.report import Problem, ServerReport, read_server
from asyncgrpo_cli.server.vllm_launch import CPU_SERVER_MODULE

log = logging.getLogger(__name__)

PROBE_TEXT = (
    'The answer is 42. Compute 17 + 25 = 42; then 3.14 * 2 = 6.28! Naïve café, straße, 東京 — "quoted" '
    "(brackets) [1, 2] {x: y} <tag> & done?"
)
PROBE_REPLY = "Let me think: 6 * 7 = 42."


@dataclass
class TeacherReport:
    """What the probe found; None where the teacher does not say."""

    teacher_id: str
    url: str
    model: str
    """The served model name: the ``model`` of every scoring request."""
    max_model_len: int | None
    max_logprobs: int | None
    """``--max-logprobs``; -1 = no cap; None = not reported (``teacher.top_k`` was checked by a request)."""
    logprobs_mode: str | None
    """Reported for the record: it does not change prompt log-probs (module doc)."""
    version: str | None
    """vLLM's version (``/version``)."""
    embedded: bool = False
    model_path: str | None = None


def probe_ids(tokenizer: Any) -> list[int]:
    """The probe text as the student tokenizes it: a chat (system, user, assistant) through its chat template, so
    the template's special tokens are in it, then the end-of-sequence token."""
    messages = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": PROBE_TEXT},
    ]
    text = None
    if getattr(tokenizer, "chat_template", None):
        for msgs in (messages, messages[1:]):  # some templates refuse a system message
            try:
                text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                break
            except Exception:
                continue
    text = (text if text is not None else PROBE_TEXT + "\n") + PROBE_REPLY + (tokenizer.eos_token or "")
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


class _Student:
    """The student tokenizer seen as the embedded server's ``ModelContext`` (what ``_decoded`` reads)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._strings: dict[int, str] = {}

    def token_string(self, token_id: int) -> str:
        s = self._strings.get(token_id)
        if s is None:
            s = self._strings[token_id] = self.tokenizer.decode([token_id])
        return s


def tokenizer_mismatch(entries: list[dict[str, Any] | None], ids: list[int], tokenizer: Any) -> str | None:
    """The first id whose teacher ``decoded_token`` differs from the student's decoding, described; None when
    every whole token agrees."""
    from asyncgrpo_cli.embedded.prompt_logprobs import _decoded  # vLLM's decoded_token (imports torch)

    student = _Student(tokenizer)
    vocab = len(tokenizer)
    if len(entries) != len(ids):
        return f"it answered {len(entries)} prompt_logprobs entries for the {len(ids)} probe tokens"
    for t in range(1, len(ids)):
        entry = entries[t] or {}
        if str(ids[t]) not in entry:
            return (
                f"its prompt_logprobs entry {t} does not hold the probe's token {ids[t]}: not vLLM's answer"
            )
        for key, value in entry.items():
            tid = int(str(key).rsplit(":", 1)[-1])
            if tid >= vocab:
                return (
                    f"it reports token id {tid} at probe position {t}, beyond the student's vocabulary of {vocab}: "
                    "its vocabulary is larger"
                )
            if student.token_string(tid).endswith("\ufffd"):
                continue  # a byte fragment (module doc)
            theirs = value.get("decoded_token") if isinstance(value, dict) else None
            if theirs is None:
                return "it reports no decoded_token, so its tokenizer cannot be compared (--skip-tokenizer-init?)"
            mine = _decoded(tid, ids[max(1, t - 4) : t], student)
            if theirs != mine:
                return f"token id {tid} (probe position {t}) is {mine!r} to the student but {theirs!r} to it"
    return None


def probe_teacher(
    teacher_id: str,
    base_url: str,
    student_tokenizer: Any,
    *,
    top_k: int,
    need_len: int,
    startup_timeout: float,
    timeout: float,
) -> TeacherReport:
    """Check one teacher against the run's needs (module doc); raise one ``UserError`` naming every gap and the
    fix. ``need_len``: the longest sequence it must score (the student's max_model_len)."""
    key = f"teacher.servers.{teacher_id}"
    head = f"teacher {teacher_id!r} at {base_url.rstrip('/')} ({key})"
    control = ServerControl(base_url, timeout)
    try:
        control.wait_ready(startup_timeout, key="teacher.startup_timeout", url_key=key)
        server = read_server(control)
    except UserError as e:
        said = (
            str(e)
            .replace(f"the generation server at {control.base_url}", "it")
            .replace("server.base_url", key)
        )
        raise UserError(f"{head}: {said}") from None
    finally:
        control.close()
    report = TeacherReport(
        teacher_id=teacher_id,
        url=server.base_url,
        model=server.model_ids[0],
        max_model_len=server.max_model_len,
        max_logprobs=server.max_logprobs,
        logprobs_mode=server.logprobs_mode,
        version=server.version,
        embedded=server.embedded,
        model_path=server.model,
    )
    problems = _length_problems(report, need_len)
    with httpx.Client(
        base_url=report.url, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0))
    ) as client:
        problems += _scoring_problems(client, report, student_tokenizer, top_k, head)
    if problems:
        raise UserError(_explain(head, problems, server))
    log.info(
        "teacher %r probe OK: %s serves %s (vLLM %s, %s, max_model_len %s, max_logprobs %s, logprobs mode %s): "
        "the student's tokenizer",
        teacher_id,
        report.url,
        report.model,
        report.version or "-",
        "embedded" if report.embedded else "external",
        report.max_model_len,
        "not reported" if report.max_logprobs is None else report.max_logprobs,
        report.logprobs_mode or "?",
    )
    return report


def _length_problems(report: TeacherReport, need_len: int) -> list[Problem]:
    need = need_len + 1
    if report.max_model_len is None or report.max_model_len >= need:
        return []
    return [
        Problem(
            f"max_model_len is {report.max_model_len}: scoring the student's longest sequence ({need_len} tokens, "
            f"its max_model_len) needs {need} positions (the request generates one token)",
            [] if report.embedded else ["--max-model-len", str(need)],
            f"teacher.embedded.max_model_len={need}" if report.embedded else None,
        )
    ]


def _scoring_problems(
    client: httpx.Client, report: TeacherReport, tokenizer: Any, top_k: int, head: str
) -> list[Problem]:
    """Checks 3 and 4 of the module doc: a scoring request at top_k (when the cap allows), the tokenizer."""
    out: list[Problem] = []
    cap = report.max_logprobs
    if cap is not None and cap != -1 and cap < top_k:
        out.append(_logprobs_problem(report, top_k, f"--max-logprobs is {cap}, below teacher.top_k={top_k}"))
    n = top_k if cap is None or cap == -1 or cap >= top_k else max(cap, 1)
    ids = probe_ids(tokenizer)
    status, body = _score(client, report, ids, n, head)
    if status == 400 and cap is None and "max allowed" in body.lower():
        out.append(_logprobs_problem(report, top_k, f"it refused prompt_logprobs={top_k}: {body}"))
        status, body = _score(client, report, ids, 1, head)
    if status != 200:
        return out + [_refused(report, status, body)]
    mismatch = tokenizer_mismatch(body, ids, tokenizer)
    if mismatch is None:
        largest = len(tokenizer) - 1
        status, body = _score(client, report, [ids[0], largest], 1, head)
        if status != 200:
            text = tokenizer.decode([largest])
            mismatch = (
                f"it refused the student's largest token id {largest} ({text!r}) (HTTP {status}: {body}): its "
                "vocabulary is smaller"
            )
        else:
            mismatch = tokenizer_mismatch(body, [ids[0], largest], tokenizer)
    if mismatch is not None:
        out.append(
            Problem(
                f"it does not share the student's tokenizer: {mismatch}. A teacher with another vocabulary trains "
                "the student toward wrong tokens",
                config_fix="serve a teacher with the student's tokenizer (its model family) at "
                f"teacher.servers.{report.teacher_id}",
            )
        )
    return out


def _score(client: httpx.Client, report: TeacherReport, ids: list[int], n: int, head: str) -> tuple[int, Any]:
    """One scoring request: (200, its ``prompt_logprobs`` list) or (status, the server's message)."""
    try:
        resp = client.post(ROUTE, json=scoring_payload(report.model, ids, n))
    except httpx.HTTPError as e:
        raise UserError(
            f"{head}: a {len(ids)}-token scoring request got no answer within teacher.timeout="
            f"{client.timeout.read:g}s ({type(e).__name__}: {e}); check the teacher or raise teacher.timeout."
        ) from None
    if resp.status_code != 200:
        return resp.status_code, _error_message(resp)
    try:
        entries = resp.json()["choices"][0]["prompt_logprobs"]
        if not isinstance(entries, list):
            raise TypeError
    except (ValueError, KeyError, IndexError, TypeError):
        raise UserError(
            f"{head} answered a scoring request without prompt_logprobs ({resp.text[:200]!r}): is it a vLLM "
            "server?"
        ) from None
    return 200, entries


def _logprobs_problem(report: TeacherReport, top_k: int, what: str) -> Problem:
    if report.embedded:
        cap = report.max_logprobs if report.max_logprobs not in (None, -1) else 20
        return Problem(what, config_fix=f"lower teacher.top_k to {cap}, the embedded server's cap")
    return Problem(what, ["--max-logprobs", "-1"], "or lower teacher.top_k")


def _refused(report: TeacherReport, status: int, message: str) -> Problem:
    fix = refusal_fix(message, report.teacher_id)
    return Problem(f"it refused to score the probe text (HTTP {status}: {message})", config_fix=fix)


def fix_command(server: ServerReport, flags: list[str]) -> str:
    """The ``vllm serve`` command line that restarts this teacher with ``flags``."""
    url = httpx.URL(server.base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    name = server.model_ids[0]
    model = server.model or name
    head = (
        ["python", "-m", CPU_SERVER_MODULE, "--model", model]
        if server.is_cpu_vllm
        else ["vllm", "serve", model]
    )
    served = ["--served-model-name", name] if name != model else []
    return shlex.join(head + served + ["--port", str(port)] + flags)


def _explain(head: str, problems: list[Problem], server: ServerReport) -> str:
    lines = [f"{head} cannot score for this run:"]
    flags: list[str] = []
    for p in problems:
        fixes = [f for f in (shlex.join(p.flags) if p.flags else None, p.config_fix) if f]
        lines.append(f"  - {p.what}" + (f" (fix: {', '.join(fixes)})" if fixes else ""))
        flags += p.flags
    if flags:  # an embedded teacher's fixes are config keys
        lines.append("Restart the teacher with (every fix applied):")
        lines.append(f"  {fix_command(server, flags)}")
    return "\n".join(lines)
