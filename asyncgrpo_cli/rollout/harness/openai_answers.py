"""The OpenAI response shapes the recording proxy answers with: chat completions (message, tool calls, log-probs),
text completions, and both as server-sent events. Pure functions over JSON-like values.

A reply's tool calls are OpenAI ``tool_calls`` entries (a fresh id each, arguments as a JSON string); a streamed
answer is the finished answer cut into chunks (the role, the content, each tool call whole, the finish reason,
the usage when asked for), closed by ``data: [DONE]``, as OpenAI streams it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from asyncgrpo_cli.rollout.agent.tool_calls import ParsedReply


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def assistant_message(reply: ParsedReply) -> dict[str, Any]:
    """The reply in OpenAI's shape: well-formed calls as ``tool_calls`` (arguments as a JSON string, a fresh
    id each); a malformed call is left out (the text around it is the content). Content is null when the reply
    is only calls."""
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in reply.calls
        if c.error is None
    ]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": reply.content if reply.content or not calls else None,
    }
    if calls:
        message["tool_calls"] = calls
    return message


def finish_reason(sampler_reason: str | None, message: dict[str, Any]) -> str:
    if sampler_reason == "length":
        return "length"
    if sampler_reason == "abort":
        return "abort"
    return "tool_calls" if message.get("tool_calls") else "stop"


def chat_logprobs(tokens: list[str], lps: list[float], tops: list[dict[str, float]] | None) -> dict[str, Any]:
    content = []
    for j, (tok, lp) in enumerate(zip(tokens, lps)):
        top = tops[j] if tops else {}
        content.append(
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in top.items()
                ],
            }
        )
    return {"content": content}


def _answer(
    prefix: str, kind: str, model: str, choice: dict[str, Any], n_prompt: int, n_completion: int
) -> dict[str, Any]:
    return {
        "id": new_id(prefix),
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, **choice}],
        "usage": usage(n_prompt, n_completion),
    }


def chat_response(
    request_model: str,
    message: dict[str, Any],
    reason: str,
    n_prompt: int,
    n_completion: int,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"message": message, "finish_reason": reason, "logprobs": logprobs}
    return _answer("chatcmpl", "chat.completion", request_model, choice, n_prompt, n_completion)


def chat_stream_events(response: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A finished chat answer as ``chat.completion.chunk`` events: the role, the content, each tool call
    whole, the finish reason, then the usage when asked for."""
    choice = response["choices"][0]
    message = choice["message"]
    base = {
        "id": response["id"],
        "object": "chat.completion.chunk",
        "created": response["created"],
        "model": response["model"],
    }

    def chunk(delta: dict[str, Any], reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {
            **base,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}],
        }

    events = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        events.append(chunk({"content": message["content"]}, logprobs=choice.get("logprobs")))
    for j, call in enumerate(message.get("tool_calls") or []):
        events.append(chunk({"tool_calls": [{"index": j, **call}]}))
    events.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        events.append({**base, "choices": [], "usage": response["usage"]})
    return events


def completion_response(
    request_model: str,
    text: str,
    reason: str,
    n_prompt: int,
    n_completion: int,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"text": text, "finish_reason": reason, "logprobs": logprobs}
    return _answer("cmpl", "text_completion", request_model, choice, n_prompt, n_completion)


def completion_logprobs(
    tokens: list[str], lps: list[float], tops: list[dict[str, float]] | None
) -> dict[str, Any]:
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": tops if tops else None,
        "text_offset": offsets,
    }


def completion_stream_events(response: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    choice = response["choices"][0]
    base = {
        "id": response["id"],
        "object": "text_completion",
        "created": response["created"],
        "model": response["model"],
    }
    events = [
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "text": choice["text"],
                    "finish_reason": None,
                    "logprobs": choice.get("logprobs"),
                }
            ],
        },
        {
            **base,
            "choices": [{"index": 0, "text": "", "finish_reason": choice["finish_reason"], "logprobs": None}],
        },
    ]
    if include_usage:
        events.append({**base, "choices": [], "usage": response["usage"]})
    return events


def sse(events: list[dict[str, Any]]) -> bytes:
    """Server-sent events, closed by ``data: [DONE]`` as OpenAI does."""
    lines = [f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events]
    lines.append("data: [DONE]\n\n")
    return "".join(lines).encode("utf-8")
