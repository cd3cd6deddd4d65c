"""A rollout loop that always runs a fixed number of turns, for multi-turn tests on models that never call a tool.

``ThreeTurnLoop`` (``rollout.loop=tests.helpers.multiturn_loop:ThreeTurnLoop``) replaces the tool loop with a plain
conversation: render it through the chat template (``render``), sample one reply (``generate_one_turn``), append
the reply as the decoded text it is (``skip_special_tokens=True``, as the tool loop does) and a user message
(``Go on.``), and repeat. So later turns reach the real extend/fork reconciliation of ``rollout/sequences.py`` with
whatever tokens the server sampled.

Options (``rollout.loop_options``):

- ``turns`` (default 3): sampling requests per rollout. A later turn whose prompt plus
  ``sampling.max_completion_length`` would not fit the server's ``max_model_len`` is not sent, as in the tool loop
  (``rollout/turns_mean`` then falls short of ``turns``);
- ``record`` (default none): a path; each finished rollout appends one JSON line there holding its turns'
  ``prompt_ids``, ``output_ids`` and ``finish_reason``, so a test can check the extend/fork rule on the
  sampled tokens. The loop runs its rollouts on one event loop thread, so whole-line appends do not interleave.

Module level (the rollout process is spawned and imports it by name).
"""

from __future__ import annotations

import json
from typing import Any

from asyncgrpo_cli.rollout.agent.episode import turn_budget
from asyncgrpo_cli.rollout.agent.tools import Tool
from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
from asyncgrpo_cli.samples import Rollout, TurnRecord

NUDGE = "Go on."
"""The user message appended after every reply."""


class ThreeTurnLoop(AsyncRolloutLoop):
    """Every rollout is ``options["turns"]`` sampling requests (3 by default) of a growing conversation."""

    async def generate_one(
        self, prompt: list[dict[str, Any]], tools: list[Tool], group_id: int = 0
    ) -> Rollout:
        turns_wanted = int(self.options.get("turns", 3))
        conversation = [dict(m) for m in prompt]
        turns: list[TurnRecord] = []
        completion: list[dict[str, Any]] = []
        for k in range(turns_wanted):
            ids = self.render(conversation)
            if (
                k
                and turn_budget(self.tool_loop.limits, len(ids))
                != self.settings.sampling.max_completion_length
            ):
                break  # the next turn would not fit max_model_len with a full completion
            turn = await self.generate_one_turn(ids)
            turns.append(turn)
            text = self.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
            reply = {"role": "assistant", "content": text}
            conversation.append(reply)
            completion.append(reply)
            if k + 1 < turns_wanted:
                nudge = {"role": "user", "content": NUDGE}
                conversation.append(nudge)
                completion.append(nudge)
        self._record(turns)
        return Rollout(
            completion=completion,
            completion_ids=[t for turn in turns for t in turn.output_ids],
            turns=turns,
        )

    def _record(self, turns: list[TurnRecord]) -> None:
        path = self.options.get("record")
        if not path:
            return
        row = [
            {
                "prompt_ids": list(t.prompt_ids),
                "output_ids": list(t.output_ids),
                "finish_reason": t.finish_reason,
            }
            for t in turns
        ]
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
