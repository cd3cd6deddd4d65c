"""The OpenAI requests the recording proxy accepts: validation, message conversion, re-sent reply keys (the
answers are ``openai_answers``).

Pure functions over JSON-like values (no server, no tokenizer), so every rule is testable on its own.

Requests the proxy cannot serve faithfully are refused with HTTP 400 naming the field (:class:`Rejected`):
training on tokens sampled under settings other than the run's would bias the importance ratios. Refused:

- more than one choice (``n`` > 1, ``best_of``, a list of prompts);
- sampling settings that differ from the run's ``sampling.*``: ``temperature``, ``top_p``, ``top_k``,
  ``min_p``, ``repetition_penalty``; any ``presence_penalty`` / ``frequency_penalty`` other than 0 (with
  ``rollout.harness.sampling_mismatch=ignore`` these are ignored instead: the reply is sampled with the run's
  settings, which trains without bias, and the request's ``ignored`` lists them); any ``logit_bias``, ``stop`` strings, ``response_format`` / guided decoding, a ``tool_choice`` other than
  ``auto`` (``none`` and named functions constrain the sampler);
- ``echo``, ``suffix``, ``continue_final_message``, non-text message parts (images, audio).

Accepted as given: ``model`` (any name; the answer echoes it), ``max_tokens`` / ``max_completion_tokens``
(capped at ``sampling.max_completion_length``: a shorter cut does not change what is sampled), ``seed``
(ignored: the run seeds requests), ``logprobs`` / ``top_logprobs`` (answered from the sampler's values),
``stream`` (the finished answer as server-sent events), ``chat_template_kwargs`` (vLLM's extension, merged over
``model.chat_template_kwargs``; not the keys of ``RESERVED_TEMPLATE_KWARGS``), ``tools``, ``parallel_tool_calls``, ``user``, ``metadata``, ``store``.
Unknown fields are ignored, as OpenAI clients send extras.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "conversation",
        "messages",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""``chat_template_kwargs`` a request may not set: what the proxy passes itself, what would swap the template, or
another parameter of ``apply_chat_template`` (``truncation`` + ``max_length`` would cut the sampled prompt)."""


class Rejected(Exception):
    """A request the proxy refuses: HTTP ``status`` with OpenAI's error shape, naming ``param``."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.message = message
        self.status = status
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class RunSampling:
    """The run's sampling settings: what a request must match (or leave unset)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_completion_length: int
    ignore_mismatch: bool = False
    """``rollout.harness.sampling_mismatch=ignore``: differing sampler settings are ignored, not refused."""


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    """Messages as the template receives them (text content, ``developer`` -> ``system``)."""
    raw_messages: list[dict[str, Any]]
    """The messages as sent (the conversation reward functions see)."""
    tools: list[dict[str, Any]] | None
    max_tokens: int
    explicit_max_tokens: bool
    """Whether the request set ``max_tokens``: a reply then may not be cut to fit ``max_model_len``."""
    model: str
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    """Sampler settings of the request that were ignored (``sampling_mismatch=ignore``)."""


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    max_tokens: int
    explicit_max_tokens: bool
    model: str
    stream: bool = False
    include_usage: bool = False
    logprobs: int = 0
    ignored: list[str] = field(default_factory=list)


def _same(value: Any, expected: float) -> bool:
    try:
        return math.isclose(float(value), float(expected), rel_tol=1e-6, abs_tol=1e-9)
    except (TypeError, ValueError):
        return False


def _check_sampling(body: dict[str, Any], run: RunSampling) -> list[str]:
    """Refuse what cannot be served faithfully; returns the sampler settings ignored (``run.ignore_mismatch``)."""
    if body.get("n") not in (None, 1):
        raise Rejected(
            "n", "n must be 1: every sample is one rollout's trace (run G rollouts for G samples)."
        )
    if body.get("best_of") not in (None, 1):
        raise Rejected("best_of", "best_of is not supported: it samples choices the trace would not record.")
    mismatched: list[tuple[str, str]] = []
    for name, run_value in (
        ("temperature", run.temperature),
        ("top_p", run.top_p),
        ("min_p", run.min_p),
        ("repetition_penalty", run.repetition_penalty),
    ):
        v = body.get(name)
        if v is not None and not _same(v, run_value):
            mismatched.append(
                (
                    name,
                    f"{name}={v} differs from the run's sampling.{name}={run_value}: tokens sampled under other "
                    f"settings would bias training; leave {name} unset or send {run_value}",
                )
            )
    top_k = body.get("top_k")
    off = {-1, 0}  # both mean "no top-k" to vLLM
    if top_k is not None and (top_k in off if run.top_k <= 0 else top_k == run.top_k) is False:
        mismatched.append(
            ("top_k", f"top_k={top_k} differs from the run's sampling.top_k={run.top_k}; leave top_k unset")
        )
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and not _same(v, 0.0):
            mismatched.append((name, f"{name}={v} is not supported (it changes the sampler); leave it unset"))
    if mismatched and not run.ignore_mismatch:
        name, why = mismatched[0]
        raise Rejected(
            name,
            f"{why} (or set rollout.harness.sampling_mismatch=ignore to sample with the run's settings).",
        )
    if body.get("logit_bias"):
        raise Rejected("logit_bias", "logit_bias is not supported (it changes the sampler); leave it unset.")
    if body.get("stop"):
        raise Rejected(
            "stop",
            "stop strings are not supported: a reply ends at the chat template's end-of-turn token or at "
            "max_tokens; cut the text in the agent instead.",
        )
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs"):
        if body.get(name) not in (None, {"type": "text"}):
            raise Rejected(name, f"{name} is not supported: constrained decoding changes the sampler.")
    return [name for name, _ in mismatched]


def _max_tokens(body: dict[str, Any], run: RunSampling) -> tuple[int, bool]:
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    requested = body.get(param)
    if requested is None:
        return run.max_completion_length, False
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise Rejected(param, f"{param} must be a positive integer, got {requested!r}.")
    return min(requested, run.max_completion_length), True


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(body.get("stream"))
    opts = body.get("stream_options") or {}
    return stream, bool(stream and isinstance(opts, dict) and opts.get("include_usage"))


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "output_text"):
                raise Rejected(
                    f"{where}.content[{j}].type",
                    f"{where}.content[{j}] is of type {kind!r}: only text parts are supported.",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise Rejected(f"{where}.content", f"{where}.content must be a string or a list of text parts.")


def template_message(message: Any, i: int) -> dict[str, Any]:
    """One OpenAI message as the chat template receives it."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise Rejected(where, f"{where} must be an object with a 'role'.")
    role = message["role"]
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise Rejected(
            f"{where}.role", f"{where}.role {role!r} is not one of system, developer, user, assistant, tool."
        )
    out: dict[str, Any] = {"role": role, "content": _text_of(message.get("content"), where)}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [
            _template_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(message["tool_calls"])
        ]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                out[key] = message[key]
    return out


def _template_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise Rejected(
            where, f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}."
        )
    return {
        "type": "function",
        "function": {"name": fn["name"], "arguments": arguments_data(fn.get("arguments"))},
    }


def arguments_data(value: Any) -> Any:
    """Arguments as data (a JSON string decoded), which is what the templates render."""
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except ValueError:
            return value
    return {} if value is None else value


def parse_chat(body: Any, run: RunSampling) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body (see the module docstring for what is refused)."""
    if not isinstance(body, dict):
        raise Rejected(None, "the request body must be a JSON object.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Rejected("messages", "messages must be a non-empty list.")
    ignored = _check_sampling(body, run)
    if body.get("continue_final_message"):
        raise Rejected("continue_final_message", "continue_final_message is not supported.")
    if body.get("add_generation_prompt") is False:
        raise Rejected("add_generation_prompt", "add_generation_prompt=false is not supported.")
    tools = body.get("tools") or None
    if tools is not None:
        if not isinstance(tools, list):
            raise Rejected("tools", "tools must be a list.")
        for j, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "function") != "function" or "function" not in t:
                raise Rejected(
                    f"tools[{j}]", f"tools[{j}] must be {{'type': 'function', 'function': {{...}}}}."
                )
    choice = body.get("tool_choice")
    if choice not in (None, "auto"):
        raise Rejected(
            "tool_choice",
            f"tool_choice={choice!r} is not supported: only 'auto' (forcing or forbidding calls constrains the "
            "sampler); leave it unset.",
        )
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise Rejected("chat_template_kwargs", "chat_template_kwargs must be an object.")
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise Rejected(
            f"chat_template_kwargs.{reserved[0]}",
            f"chat_template_kwargs.{reserved[0]} is the proxy's to set (the run's training template renders every "
            "request the same way); send only template variables such as enable_thinking.",
        )
    top = body.get("top_logprobs") or 0
    if not isinstance(top, int) or not 0 <= top <= 20:
        raise Rejected("top_logprobs", f"top_logprobs must be an integer in [0, 20], got {top!r}.")
    stream, usage = _stream_options(body)
    max_tokens, explicit = _max_tokens(body, run)
    return ChatRequest(
        messages=[template_message(m, i) for i, m in enumerate(messages)],
        raw_messages=messages,
        tools=tools,
        max_tokens=max_tokens,
        explicit_max_tokens=explicit,
        model=str(body.get("model") or ""),
        stream=stream,
        include_usage=usage,
        logprobs=bool(body.get("logprobs")),
        top_logprobs=top,
        template_kwargs=dict(kwargs),
        ignored=ignored,
    )


def parse_completion(body: Any, run: RunSampling) -> CompletionRequest:
    """Validate a ``/v1/completions`` body: one prompt, a string or a list of token ids."""
    if not isinstance(body, dict):
        raise Rejected(None, "the request body must be a JSON object.")
    prompt = body.get("prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        pass
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if not (isinstance(prompt, str) and prompt) and not (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):
        raise Rejected(
            "prompt",
            "prompt must be one non-empty string or one list of token ids (a batch is not supported).",
        )
    ignored = _check_sampling(body, run)
    for name in ("echo", "suffix"):
        if body.get(name):
            raise Rejected(name, f"{name} is not supported.")
    lp = body.get("logprobs") or 0
    if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 20:
        raise Rejected("logprobs", f"logprobs must be an integer in [0, 20], got {lp!r}.")
    stream, usage = _stream_options(body)
    max_tokens, explicit = _max_tokens(body, run)
    return CompletionRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        explicit_max_tokens=explicit,
        model=str(body.get("model") or ""),
        stream=stream,
        include_usage=usage,
        logprobs=lp,
        ignored=ignored,
    )


def reply_key(message: dict[str, Any]) -> str:
    """What identifies an assistant message the proxy answered when an agent sends it back in its history:
    the stripped content and each call's name and arguments (as data, so a client that re-serializes the
    arguments JSON still matches). Call ids are not part of it (agents often drop or rewrite them)."""
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict):
            calls.append([fn.get("name"), arguments_data(fn.get("arguments"))])
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    return json.dumps([text.strip(), calls], sort_keys=True, ensure_ascii=False, default=str)


def with_argument_data(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with every tool call's ``arguments`` as data, the shape the tool loop's completions have
    (reward functions read one shape); other fields as they are."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            m = {
                **m,
                "tool_calls": [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": arguments_data(c["function"].get("arguments")),
                        },
                    }
                    if isinstance(c, dict) and isinstance(c.get("function"), dict)
                    else c
                    for c in calls
                ],
            }
        out.append(m)
    return out
