"""The multi-turn tool loop (``rollout/agent/episode.py``) and what its rollouts become (``rollout/sequences.py``,
the GRPO scorer).

``ToolLoop.run`` is driven by a scripted ``generate_turn`` (the tiny tokenizer's encoding of scripted replies, plus
eos when the reply stopped) and renders for real: the tiny tokenizer with the ChatML training template that
``choose_chat_template`` swaps in. No server; the tools live in ``tests/helpers/agent_tools.py``.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest

from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.model.tiny import build_tiny_tokenizer
from asyncgrpo_cli.rollout.agent.episode import EpisodeLimits, ToolLoop
from asyncgrpo_cli.rollout.agent.templates import choose_chat_template
from asyncgrpo_cli.rollout.agent.tool_calls import HermesToolCallParser
from asyncgrpo_cli.rollout.agent.tools import load_tools
from asyncgrpo_cli.rollout.scorers import ScorerContext
from asyncgrpo_cli.rollout.scorers.grpo import GroupScorer, group_advantages
from asyncgrpo_cli.rollout.sequences import rollout_to_sequences
from asyncgrpo_cli.samples import RolloutGroup, TurnRecord
from tests.helpers import agent_tools

H = "tests.helpers.agent_tools:"
PROMPT = [{"role": "user", "content": "What is 3 times 4?"}]
LIMITS = EpisodeLimits(
    max_model_len=100_000,
    max_completion_length=64,
    sampling_mask=False,
    max_tool_calling_iterations=None,
    tool_timeout_s=10.0,
    record_tool_metrics=True,
)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tiny_tokenizer()
    choice = choose_chat_template(tokenizer, {}, require_prefix_preserving=True)
    assert choice.family == "chatml" and choice.problem is None
    tokenizer.chat_template = choice.template
    return tokenizer


@pytest.fixture(scope="module")
def executor():
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="tool") as pool:
        yield pool


def make_render(tok):
    def render(messages, schemas):
        extra = {"tools": schemas} if schemas else {}
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]

    return render


class Script:
    """``generate_turn``: answers each request with the next scripted reply, recording what it was sent.

    A reply is a string (it stopped: its ids end with eos) or ``(text, finish_reason)``; "length" ends without
    eos. Log-probs are ``-0.01 * (turn + 1)`` per token so the turns stay distinguishable in a sample."""

    def __init__(self, tok, replies, output_mask: int | None = None):
        self.tok = tok
        self.replies = list(replies)
        self.output_mask = output_mask
        self.requests: list[tuple[list[int], int | None]] = []

    async def __call__(self, prompt_ids, max_tokens=None):
        reply = self.replies[len(self.requests)]
        text, finish = (reply, "stop") if isinstance(reply, str) else reply
        self.requests.append((list(prompt_ids), max_tokens))
        ids = self.tok.encode(text) + ([self.tok.eos_token_id] if finish == "stop" else [])
        n = len(self.requests)
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=ids,
            output_log_probs=[-0.01 * n] * len(ids),
            output_mask=None if self.output_mask is None else [self.output_mask] * len(ids),
            finish_reason=finish,
        )


def run(tok, replies, tools=(), limits=LIMITS, executor=None, render=None, output_mask=None):
    """One rollout; returns (rollout, script, reduced metrics)."""
    metrics = MetricWindow()
    loop = ToolLoop(
        limits,
        HermesToolCallParser(),
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        metrics,
        executor,
    )
    script = Script(tok, replies, output_mask)
    tool_list = load_tools([H + name for name in tools])
    rollout = asyncio.run(loop.run(PROMPT, tool_list, render or make_render(tok), script))
    return rollout, script, metrics.reduce()


# -- the loop ----------------------------------------------------------------------------------------------------
def test_a_reply_without_a_call_ends_the_rollout_in_one_turn(tok):
    rollout, script, m = run(tok, ["It is 12."], tools=["multiply"])
    assert len(rollout.turns) == 1 and len(script.requests) == 1
    assert rollout.completion == [{"role": "assistant", "content": "It is 12."}]
    assert rollout.completion_ids == tok.encode("It is 12.") + [tok.eos_token_id]
    assert (rollout.tool_call_count, rollout.tool_failure_count) == (0, 0)
    assert m["tools/call_frequency"] == 0 and m["tools/loop_exhausted_frac"] == 0
    assert "multiply" in tok.decode(script.requests[0][0])  # the schema is in the prompt


def test_a_call_then_an_answer_is_two_turns_in_openai_shape(tok):
    first = "Let me multiply.\n" + call("multiply", a=3, b=4)
    rollout, script, m = run(tok, [first, "It is 12."], tools=["multiply"])
    assert len(rollout.turns) == 2
    p1, p2 = (r[0] for r in script.requests)
    out1 = rollout.turns[0].output_ids
    assert p2[: len(p1) + len(out1)] == p1 + out1  # the template re-renders history as sampled
    assert (
        tok.decode(p2[len(p1) + len(out1) :]) == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rollout.completion == [
        {
            "role": "assistant",
            "content": "Let me multiply.",
            "tool_calls": [
                {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
            ],
        },
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": "It is 12."},
    ]
    assert rollout.completion_ids == out1 + rollout.turns[1].output_ids
    assert (rollout.tool_call_count, rollout.tool_failure_count) == (1, 0)
    assert m["tools/call_frequency"] == 1 and m["tools/failure_frequency"] == 0
    assert m["tools/multiply/call_count"] == 1 and m["tools/loop_exhausted_frac"] == 0


def test_several_calls_of_one_turn_run_in_the_written_order(tok, executor):
    agent_tools.CALL_LOG.clear()
    first = call("record", tag="slow", seconds=0.2) + call("record", tag="fast", seconds=0.0)
    rollout, _, m = run(tok, [first, "done"], tools=["record"], executor=executor)
    assert agent_tools.CALL_LOG == ["slow", "fast"]  # sequential: the slow one finished first
    assert [msg["content"] for msg in rollout.completion if msg["role"] == "tool"] == ["slow", "fast"]
    assert rollout.tool_call_count == 2 and m["tools/parallel_calls_mean"] == 2


def test_unknown_names_and_raising_tools_fail_the_call_not_the_rollout(tok, executor):
    first = call("multiply", a=2, b=5) + call("divide", a=1, b=2) + call("explode", reason="boom")
    rollout, script, m = run(tok, [first, "sorry"], tools=["multiply", "explode"], executor=executor)
    assert len(rollout.turns) == 2 and (rollout.tool_call_count, rollout.tool_failure_count) == (3, 2)
    results = [msg["content"] for msg in rollout.completion if msg["role"] == "tool"]
    assert results[0] == "10"
    assert results[1].startswith("error: there is no tool named 'divide'")
    assert results[2] == "error: RuntimeError: boom"
    assert "error: RuntimeError: boom" in tok.decode(script.requests[1][0])  # the model reads the error
    assert m["tools/unknown_name_count"] == 1 and m["tools/explode/failure_count"] == 1
    assert m["tools/failure_frequency"] == pytest.approx(2 / 3)
    assert "tools/divide/call_count" not in m  # made-up names never become metric names


@pytest.mark.parametrize("iterations", [0, 1])
def test_the_iteration_cap_ends_a_rollout_that_keeps_calling(tok, iterations):
    replies = [call("multiply", a=1, b=i) for i in range(3)]
    limits = replace(LIMITS, max_tool_calling_iterations=iterations)
    rollout, script, m = run(tok, replies, tools=["multiply"], limits=limits)
    assert len(rollout.turns) == iterations + 1 and len(script.requests) == iterations + 1
    assert rollout.tool_call_count == iterations  # the last reply's call is not run
    assert rollout.completion[-1]["role"] == "assistant" and "tool_calls" in rollout.completion[-1]
    assert m["tools/loop_exhausted_frac"] == 1


def test_a_reply_cut_at_max_tokens_runs_no_call(tok):
    rollout, script, m = run(tok, [(call("multiply", a=3, b=4), "length")], tools=["multiply"])
    assert len(rollout.turns) == 1 and rollout.turns[0].output_ids[-1] != tok.eos_token_id
    assert rollout.tool_call_count == 0 and not any(msg["role"] == "tool" for msg in rollout.completion)
    assert m["tools/call_frequency"] == 0 and m["tools/loop_exhausted_frac"] == 0


# -- max_model_len (episode.py rule 3) ------------------------------------------------------------------------------
def test_max_model_len_without_sampling_masks(tok):
    replies = [call("multiply", a=3, b=4), "It is 12."]
    _, probe, _ = run(tok, replies, tools=["multiply"])
    p1, p2 = (len(r[0]) for r in probe.requests)
    c = LIMITS.max_completion_length
    # The first turn is sent even when it does not fit; a later turn only when prompt + max_completion fits.
    rollout, script, m = run(tok, replies, tools=["multiply"], limits=replace(LIMITS, max_model_len=p1))
    assert len(script.requests) == 1 and script.requests[0][1] is None
    assert rollout.tool_call_count == 1 and rollout.completion[-1]["role"] == "tool"  # the call ran
    assert m["rollout/max_model_len_stop_count"] == 1
    rollout, script, m = run(
        tok, replies, tools=["multiply"], limits=replace(LIMITS, max_model_len=p2 + c - 1)
    )
    assert len(script.requests) == 1 and m["rollout/max_model_len_stop_count"] == 1
    rollout, script, m = run(tok, replies, tools=["multiply"], limits=replace(LIMITS, max_model_len=p2 + c))
    assert [r[1] for r in script.requests] == [None, None]  # fits: sent with the configured max_tokens
    assert "rollout/max_model_len_stop_count" not in m


def test_max_model_len_with_sampling_masks_lowers_max_tokens(tok):
    replies = [call("multiply", a=3, b=4), "It is 12."]
    _, probe, _ = run(tok, replies, tools=["multiply"])
    p2 = len(probe.requests[1][0])
    masked = replace(LIMITS, sampling_mask=True)
    rollout, script, m = run(tok, replies, tools=["multiply"], limits=replace(masked, max_model_len=p2 + 5))
    assert [r[1] for r in script.requests] == [None, 5] and len(rollout.turns) == 2
    assert "rollout/max_model_len_stop_count" not in m
    rollout, script, m = run(tok, replies, tools=["multiply"], limits=replace(masked, max_model_len=p2))
    assert len(script.requests) == 1 and m["rollout/max_model_len_stop_count"] == 1  # no room left at all
    _, script, _ = run(tok, replies, tools=["multiply"], limits=replace(masked, max_model_len=p2 + 1000))
    assert [r[1] for r in script.requests] == [None, None]


# -- reconciliation and scoring --------------------------------------------------------------------------------------
def three_turns(tok, **kw):
    replies = [call("multiply", a=3, b=4), call("multiply", a=12, b=2), "It is 24."]
    return run(tok, replies, tools=["multiply"], **kw)


def test_a_clean_three_turn_rollout_is_one_sample_training_exactly_the_sampled_tokens(tok):
    rollout, _, _ = three_turns(tok)
    (sample,), stats = rollout_to_sequences(rollout, num_topk=0)
    last = rollout.turns[-1]
    assert sample.input_ids.tolist() == last.prompt_ids + last.output_ids
    expected = np.zeros(len(sample), dtype=bool)
    logprobs = np.zeros(len(sample), dtype=np.float32)
    for turn in rollout.turns:
        start = len(turn.prompt_ids)
        assert sample.input_ids[start : start + len(turn.output_ids)].tolist() == turn.output_ids
        expected[start : start + len(turn.output_ids)] = True
        logprobs[start : start + len(turn.output_ids)] = turn.output_log_probs
    np.testing.assert_array_equal(sample.train_mask, expected)  # prompt and tool tokens: 0
    np.testing.assert_allclose(sample.sampler_logprobs, logprobs)
    assert sample.num_trained == len(rollout.completion_ids)
    assert (stats.transitions, stats.forks, stats.drift_tokens) == (2, 0, [0, 0])
    assert sample.rollout_id == rollout.rollout_id


def test_a_history_rendered_differently_forks_and_trains_every_token_once(tok):
    base = make_render(tok)

    def drifting(messages, schemas):  # a template that re-serializes assistant turns (drops the markup)
        edited = [
            {"role": "assistant", "content": "(called a tool)"} if m["role"] == "assistant" else m
            for m in messages
        ]
        return base(edited, schemas)

    rollout, _, _ = run(tok, [call("multiply", a=3, b=4), "It is 12."], tools=["multiply"], render=drifting)
    samples, stats = rollout_to_sequences(rollout, num_topk=0)
    t1, t2 = rollout.turns
    assert len(samples) == 2 and stats.forks == 1
    assert samples[0].input_ids.tolist() == t1.prompt_ids + t1.output_ids
    assert samples[1].input_ids.tolist() == t2.prompt_ids + t2.output_ids
    assert [s.num_trained for s in samples] == [len(t1.output_ids), len(t2.output_ids)]
    trained = [t for s in samples for t in s.input_ids[s.train_mask].tolist()]
    assert trained == rollout.completion_ids  # each generated token trained exactly once
    kept = t1.prompt_ids + t1.output_ids
    same = next(i for i, (a, b) in enumerate(zip(kept, t2.prompt_ids)) if a != b)
    assert stats.drift_tokens == [len(kept) - same] and 0 < same < len(kept)


def test_a_rollout_without_trained_tokens_yields_no_sample(tok):
    rollout, _, _ = three_turns(tok, output_mask=0)
    assert len(rollout.turns) == 3
    samples, _ = rollout_to_sequences(rollout, num_topk=0)
    assert samples == []


def test_every_sample_of_a_rollout_gets_its_advantage(tok):
    base = make_render(tok)

    def drifting(messages, schemas):
        return base([dict(m, content="x") if m["role"] == "assistant" else m for m in messages], schemas)

    rollouts = [three_turns(tok, render=drifting)[0], three_turns(tok)[0], run(tok, ["no tool"])[0]]
    for r, reward in zip(rollouts, [1.0, 0.0, 0.5]):
        r.reward = reward
    seqs = [rollout_to_sequences(r, num_topk=0)[0] for r in rollouts]
    assert [len(s) for s in seqs] == [3, 1, 1]  # the drifting rollout forked at both transitions
    group = RolloutGroup(
        prompts=[PROMPT] * 3,
        reward_kwargs={},
        completions=[r.completion for r in rollouts],
        completions_ids=[r.completion_ids for r in rollouts],
        completions_sequences=seqs,
        model_version=2,
        group_id=7,
        row_index=0,
        rollout_rewards=[r.reward for r in rollouts],
        rollouts=rollouts,
    )
    scorer = GroupScorer(ScorerContext([], MetricWindow(), None, settings=None))
    scored = asyncio.run(scorer.score(group))
    adv = group_advantages(np.array([1.0, 0.0, 0.5]))
    assert len(scored.samples) == 5 and all(s.group_num_samples == 5 for s in scored.samples)
    by_rollout = {r.rollout_id: i for i, r in enumerate(rollouts)}
    for s in scored.samples:
        assert s.advantage == pytest.approx(adv[by_rollout[s.rollout_id]])
    assert sorted({s.advantage for s in scored.samples}) == pytest.approx(sorted(adv))
