"""Reading tool calls out of a sampled assistant reply. Text in, ``ParsedReply`` out: no tokenizer, no tools.

The parser only reads; it never rewrites the reply (the conversation keeps the raw decoded text, tool-call markup
included, so the chat template sees exactly what the model wrote). A call the model got wrong is not dropped: it
becomes a ``ToolCall`` with ``error`` set, so the episode can answer it with an error message the model can read
and the metrics can count it.

Formats, picked by ``rollout.tool_call_format``:

- ``hermes`` (Qwen3, Qwen2.5, Hermes, SmolLM2): every ``<tool_call>...</tool_call>`` block is a call whose body is
  JSON, either one object ``{"name": str, "arguments": object}`` or a list of such objects (several calls in one
  block, in order). ``arguments`` may be missing (= ``{}``) or a JSON string that decodes to an object. A final
  ``<tool_call>`` with no closing tag (the reply was cut off) is one malformed call. Text outside the blocks is
  the reply's ``content``. The scan is linear in the length of the reply (``str.find``, no backtracking regex).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from asyncgrpo_cli.errors import UserError


@dataclass
class ToolCall:
    """One call the model wrote, well-formed or not."""

    name: str
    """The tool's name; "" when it could not be read."""
    arguments: dict[str, Any]
    """Keyword arguments for the tool; ``{}`` for a malformed call."""
    error: str | None = None
    """Why the block is malformed (bad JSON, no "name", arguments not an object); None for a well-formed call."""

    def message_entry(self) -> dict[str, Any]:
        """The call in the OpenAI ``tool_calls`` shape."""
        return {"type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}


@dataclass
class ParsedReply:
    """A sampled reply split into its text and its tool calls."""

    content: str
    """The text outside the tool-call blocks, stripped."""
    calls: list[ToolCall]
    """The calls in the order the model wrote them (empty: the reply ends the episode)."""


class ToolCallParser(Protocol):
    """Reads the tool calls of one model family's format."""

    name: ClassVar[str]

    def parse(self, text: str) -> ParsedReply: ...


_NAME_FIELD = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
"""The "name" of a body that is not valid JSON (alternatives are disjoint: linear, no catastrophic backtracking)."""


class HermesToolCallParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen3, Qwen2.5, Hermes, SmolLM2)."""

    name: ClassVar[str] = "hermes"
    open_tag: ClassVar[str] = "<tool_call>"
    close_tag: ClassVar[str] = "</tool_call>"

    def parse(self, text: str) -> ParsedReply:
        outside: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                outside.append(text[pos:])
                break
            outside.append(text[pos:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            if end < 0:
                body = text[body_start:]
                calls.append(
                    ToolCall(
                        name=_readable_name(body),
                        arguments={},
                        error=f"the {self.open_tag} block is never closed with {self.close_tag} "
                        "(the reply was cut off?)",
                    )
                )
                break
            calls.extend(_calls_of_body(text[body_start:end]))
            pos = end + len(self.close_tag)
        return ParsedReply(content="".join(outside).strip(), calls=calls)


def _calls_of_body(body: str) -> list[ToolCall]:
    """The calls of one block's JSON body: one object, or a list of objects."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        return [ToolCall(_readable_name(body), {}, f"the tool call is not valid JSON: {e.msg} at {where}")]
    if isinstance(value, list):
        if not value:
            return [ToolCall("", {}, "the tool-call block holds an empty list")]
        return [_call_of_value(item) for item in value]
    return [_call_of_value(value)]


def _call_of_value(value: Any) -> ToolCall:
    """One decoded call: ``{"name": str, "arguments": object | JSON string of an object}``."""
    if not isinstance(value, dict):
        kind = type(value).__name__
        return ToolCall(
            "", {}, f'a tool call must be a JSON object {{"name": ..., "arguments": ...}}, got {kind}'
        )
    name = value.get("name")
    if not isinstance(name, str) or not name:
        got = "missing" if name is None else f"{name!r}"
        return ToolCall("", {}, f'the tool call\'s "name" must be a non-empty string ({got})')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return ToolCall(name, {}, f'"arguments" is a string that is not valid JSON: {e.msg}')
    if not isinstance(arguments, dict):
        kind = "null" if arguments is None else type(arguments).__name__
        return ToolCall(name, {}, f'"arguments" must be a JSON object of named arguments, got {kind}')
    return ToolCall(name, arguments)


def _readable_name(body: str) -> str:
    """The ``"name": "..."`` value of a body that does not decode (truncated or broken JSON), else ""."""
    match = _NAME_FIELD.search(body)
    if match is None:
        return ""
    try:
        name = json.loads(match.group(1))
    except json.JSONDecodeError:
        return ""
    return name if isinstance(name, str) else ""


_PARSERS: dict[str, type[ToolCallParser]] = {HermesToolCallParser.name: HermesToolCallParser}


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser of ``rollout.tool_call_format``."""
    cls = _PARSERS.get(name)
    if cls is None:
        raise UserError(
            f"rollout.tool_call_format: unknown tool-call format {name!r}; choices: {', '.join(sorted(_PARSERS))}"
        )
    return cls()
