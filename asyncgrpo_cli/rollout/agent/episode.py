"""The multi-turn tool loop: the default ``AsyncRolloutLoop.generate_one``.

Each turn renders the whole conversation through the chat template (with the rollout's tool schemas) and samples
the reply from the rendered token ids; the sampled ids and log-probs are recorded as a ``TurnRecord`` and never
re-tokenized. The reply is appended to the conversation as the decoded text it is, tool-call markup included (the
template never re-serializes parsed calls, which would drift from what was sampled). Its tool calls run in the
order written (``tools.run_tool_calls``) and each result is appended as a ``tool`` message. The loop ends when

1. a reply calls no tool, or did not finish (cut at ``sampling.max_completion_length`` or aborted: its calls
   are not run);
2. ``rollout.max_tool_calling_iterations`` rounds have run and the reply still calls tools
   (``tools/loop_exhausted_frac``);
3. the next turn does not fit the server's ``max_model_len``: without sampling masks a turn is sent only when its
   prompt plus ``max_completion_length`` fits (the server would reject it); with sampling masks
   (``/inference/v1/generate``) a turn is sent while its prompt is shorter than ``max_model_len`` and its
   ``max_tokens`` is cut to the room left, as the server stops such a turn there itself
   (``rollout/max_model_len_stop_count``). The first turn is always sent: a dataset prompt that does not fit is a
   configuration error the server reports.

Turns become training samples at the end of the rollout (``rollout/sequences.py``: extend or fork). The rollout's
``completion`` (what reward functions see) is the OpenAI-shaped message list after the prompt: assistant messages
with the text outside tool calls as ``content`` and the parsed ``tool_calls``, and the ``tool`` messages.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.agent.tool_calls import ParsedReply, ToolCallParser
from asyncgrpo_cli.rollout.agent.tools import Tool, run_tool_calls
from asyncgrpo_cli.samples import Rollout, TurnRecord

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]]
GenerateTurn = Callable[..., Awaitable[TurnRecord]]


@dataclass
class EpisodeLimits:
    max_model_len: int
    max_completion_length: int
    sampling_mask: bool
    """Turns go to ``/inference/v1/generate``, which stops a turn at ``max_model_len`` instead of rejecting it."""
    max_tool_calling_iterations: int | None
    tool_timeout_s: float | None
    record_tool_metrics: bool
    """Whether the run has tools (the ``tools/*`` per-rollout metrics are logged only then)."""


def turn_budget(limits: EpisodeLimits, prompt_len: int) -> int | None:
    """``max_tokens`` for a later turn with a ``prompt_len``-token prompt; None: the turn is not sent (rule 3)."""
    room = limits.max_model_len - prompt_len
    if limits.sampling_mask:
        return min(limits.max_completion_length, room) if room > 0 else None
    return limits.max_completion_length if room >= limits.max_completion_length else None


class ToolLoop:
    """Runs one rollout's turns; built once per rollout loop, shared by its concurrent rollouts (no state)."""

    def __init__(
        self,
        limits: EpisodeLimits,
        parser: ToolCallParser,
        decode: Callable[[list[int]], str],
        metrics: MetricWindow,
        executor: Executor | None,
    ):
        self.limits = limits
        self.parser = parser
        self.decode = decode
        self.metrics = metrics
        self.executor = executor

    async def run(
        self, prompt: list[dict[str, Any]], tools: list[Tool], render: Render, generate_turn: GenerateTurn
    ) -> Rollout:
        conversation = [dict(m) for m in prompt]
        schemas = [t.schema for t in tools] or None
        by_name = {t.name: t for t in tools}
        turns: list[TurnRecord] = []
        completion: list[dict[str, Any]] = []
        completion_ids: list[int] = []
        calls = failures = rounds = 0
        exhausted = False
        while True:
            prompt_ids = render(conversation, schemas)
            if not turns:
                turn = await generate_turn(prompt_ids)
            else:
                budget = turn_budget(self.limits, len(prompt_ids))
                if budget is None:
                    self.metrics.add("rollout/max_model_len_stop_count", 1)
                    break
                turn = await (
                    generate_turn(prompt_ids)
                    if budget == self.limits.max_completion_length
                    else generate_turn(prompt_ids, max_tokens=budget)
                )
            turns.append(turn)
            completion_ids.extend(turn.output_ids)
            text = self.decode(turn.output_ids)
            conversation.append({"role": "assistant", "content": text})
            reply = self.parser.parse(text) if tools else ParsedReply(text, [])
            completion.append(_assistant_message(reply))
            if not reply.calls or turn.finish_reason not in ("stop", None):  # cut or aborted: calls not run
                break
            if (
                self.limits.max_tool_calling_iterations is not None
                and rounds >= self.limits.max_tool_calling_iterations
            ):
                exhausted = True
                break
            results = await run_tool_calls(
                reply.calls, by_name, self.executor, self.metrics, self.limits.tool_timeout_s
            )
            rounds += 1
            calls += len(results)
            failures += sum(r.failed for r in results)
            for r in results:
                conversation.append(r.message())
                completion.append(r.message())
        if self.limits.record_tool_metrics:
            self.metrics.add("tools/call_frequency", calls)
            self.metrics.add_rate("tools/failure_frequency", failures, calls)
            self.metrics.add("tools/loop_exhausted_frac", float(exhausted))
        return Rollout(
            completion=completion,
            completion_ids=completion_ids,
            turns=turns,
            tool_call_count=calls,
            tool_failure_count=failures,
        )


def _assistant_message(reply: ParsedReply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.calls:
        message["tool_calls"] = [c.message_entry() for c in reply.calls]
    return message
