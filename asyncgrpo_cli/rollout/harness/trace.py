"""What the proxy records for one harness rollout (a ``Trace``), and how it becomes a ``Rollout``.

Every request the proxy served becomes a ``TurnRecord`` (the prompt ids it rendered, the sampled ids and their
sampler log-probs, top-k and candidate sets, exactly as the tool loop records its turns), in the order the
answers were sent. ``rollout/sequences.py`` turns them into samples afterwards: a turn extends the longest open
sample whose tokens start its prompt, a turn no sample prefixes forks (every sampled token trained once); so
conversations an agent interleaves (sub-agents) give one sample each.

Re-sent replies: an agent sends the replies it got back in its history, re-serialized by its client (tool calls
as OpenAI objects, content without the call markup). Rendered through the template, that text would differ
from what was sampled, and every turn would fork. So the trace remembers the raw decoded text of every reply it
answered, keyed by ``openai_api.reply_key``; an assistant message that matches one is rendered as that raw text,
as the tool loop renders its own replies. An agent that edits a reply gets its edit rendered (and a fork).

What reward functions see: ``Rollout.prompt`` is the first chat request's messages as sent, and
``Rollout.completion`` what the last chat request added after them, plus the reply to it (the agent's final
conversation; all of the last request's messages when it does not start with the first's); tool calls'
``arguments`` are data there (JSON strings decoded), as in the tool loop's completions. A harness that only
used ``/v1/completions`` gets the row's prompt and ``[{"role": "assistant", "content": <last completion text>}]``.
"""

from __future__ import annotations

import asyncio
import contextvars
import weakref
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo_cli.rollout.harness.openai_api import reply_key, with_argument_data
from asyncgrpo_cli.samples import Rollout, TurnRecord


@dataclass
class Trace:
    """One rollout's requests: owned by the proxy while the harness runs, read by the runner after."""

    token: str
    turns: list[TurnRecord] = field(default_factory=list)
    replies: dict[str, list[str]] = field(default_factory=dict)
    """``reply_key`` of an answered assistant message -> the raw decoded texts sampled under it, in order (two
    replies may look alike once parsed: the k-th such message of a request history takes the k-th text)."""
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    """The rollout task's context, which its requests are sampled in (``TraceTable.open``)."""
    sampling_s: float = 0.0
    """Seconds its requests spent waiting on the policy server (summed; concurrent requests overlap)."""
    first_messages: list[dict[str, Any]] | None = None
    conversation: list[dict[str, Any]] | None = None
    """The last chat request's messages as sent, plus the reply to it."""
    last_text: str | None = None
    """The last ``/v1/completions`` answer's text."""
    inflight: set[asyncio.Task] = field(default_factory=set)
    cancelled: set[asyncio.Task] = field(default_factory=set)
    """Requests ``close`` cancelled (their handlers answer 401 instead of propagating the cancellation)."""
    closed: bool = False
    late_requests: int = 0
    """Requests still in flight when the harness exited (cancelled), or sent with its token after that."""
    rollout: weakref.ref[Rollout] | None = None
    """The rollout built from this trace (``release``): a late request unscores it while it lives."""
    server_error: BaseException | None = None
    """A failure of the policy server while serving this rollout (re-raised by the runner: the run stops, as
    the tool loop's would)."""

    def request_after_exit(self) -> None:
        """A request came with this trace's token after the harness exited."""
        self.late_requests += 1
        rollout = self.rollout() if self.rollout is not None else None
        if rollout is not None and rollout.unscored is None:
            rollout.unscored = "a process of the harness sent a request after it exited"

    def release(self, rollout: Rollout) -> None:
        """The rollout is built: keep only what answers a late request (the token table keeps ended traces)."""
        self.rollout = weakref.ref(rollout)
        self.turns, self.replies, self.first_messages, self.conversation, self.last_text = (
            [],
            {},
            None,
            None,
            None,
        )

    def raw_text(self, message: dict[str, Any], seen: dict[str, int]) -> str | None:
        """The sampled text of an assistant message this trace answered, or None; ``seen`` counts the keys met
        so far in the same request history."""
        if message.get("role") != "assistant":
            return None
        key = reply_key(message)
        texts = self.replies.get(key)
        if not texts:
            return None
        k = seen.get(key, 0)
        seen[key] = k + 1
        return texts[min(k, len(texts) - 1)]

    def record_chat(
        self, turn: TurnRecord, raw_messages: list[dict[str, Any]], message: dict[str, Any], text: str
    ) -> None:
        self.turns.append(turn)
        self.replies.setdefault(reply_key(message), []).append(text)
        if self.first_messages is None:
            self.first_messages = list(raw_messages)
        self.conversation = [*raw_messages, message]

    def record_completion(self, turn: TurnRecord, text: str) -> None:
        self.turns.append(turn)
        self.last_text = text

    def close(self) -> int:
        """Stop accepting requests; cancel those in flight (returns how many were). Idempotent."""
        if self.closed:
            return 0
        self.closed = True
        pending = [t for t in self.inflight if not t.done()]
        for t in pending:
            self.cancelled.add(t)
            t.cancel()
        self.late_requests += len(pending)
        return len(pending)


def trace_rollout(trace: Trace) -> Rollout:
    """The trace as a ``Rollout`` (reward and unscored reason are the runner's to set)."""
    completion_ids = [t for turn in trace.turns for t in turn.output_ids]
    prompt: list[dict[str, Any]] | None = None
    completion: list[dict[str, Any]]
    if trace.conversation is not None:
        first = trace.first_messages or []
        conv = trace.conversation
        prompt = with_argument_data(first)
        completion = with_argument_data(conv[len(first) :] if conv[: len(first)] == first else conv)
    elif trace.last_text is not None:
        completion = [{"role": "assistant", "content": trace.last_text}]
    else:
        completion = []
    return Rollout(
        completion=completion, completion_ids=completion_ids, turns=list(trace.turns), prompt=prompt
    )
