"""What a harness rollout's trace trains: hand-written ``Trace`` objects (``rollout/harness/trace.py``) through
``trace_rollout`` and the multi-turn reconciliation (``rollout/sequences.py``'s ``rollout_to_sequences``).

Boundary: pure data, no proxy, no tokenizer. Token ids are small made-up integers, each turn's log-probs are
distinct per turn, so every check can say which turn a trained token came from. Rules checked: a turn whose
prompt starts with an open sample's tokens extends it (its prompt tail is context), any other turn forks
(interleaved conversations: tests/test_sequences_interleaved.py); every sampled token is trained exactly once, with its own log-prob and top-k entries; a turn with no
sampled token trains nothing and breaks nothing; and what reward functions see (``Rollout.prompt`` /
``completion``) follows trace.py's docstring for chat, completions-only and empty traces.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asyncgrpo_cli.rollout.harness import openai_api as api
from asyncgrpo_cli.rollout.harness.trace import Trace, trace_rollout
from asyncgrpo_cli.rollout.sequences import rollout_to_sequences
from asyncgrpo_cli.samples import SAMPLER_TOPK, TurnRecord

EOS = 2


def turn(prompt: list[int], output: list[int], n: int, topk: bool = False) -> TurnRecord:
    """Turn ``n`` (1-based): every output token has log-prob ``-n / 10``; with ``topk``, a second candidate."""
    return TurnRecord(
        prompt_ids=list(prompt),
        output_ids=list(output),
        output_log_probs=[-n / 10] * len(output),
        output_sampler_logprobs=[{t: -n / 10, t + 500: -3.0} for t in output] if topk else None,
        finish_reason="stop" if output and output[-1] == EOS else "length",
    )


def trace_of(*turns: TurnRecord) -> Trace:
    return Trace(token="agrpo-test", turns=list(turns))


def samples_of(trace: Trace, num_topk: int = 0):
    rollout = trace_rollout(trace)
    samples, stats = rollout_to_sequences(rollout, num_topk)
    for s in samples:
        assert s.rollout_id == rollout.rollout_id
    return rollout, samples, stats


def trained(sample) -> list[int]:
    return sample.input_ids[sample.train_mask].tolist()


def assert_each_sampled_token_trained_once(trace: Trace, samples) -> None:
    expected = [t for tr in trace.turns for t in tr.output_ids]
    assert [t for s in samples for t in trained(s)] == expected
    lps = [lp for tr in trace.turns for lp in tr.output_log_probs]
    got = np.concatenate([s.sampler_logprobs[s.train_mask] for s in samples]) if samples else []
    assert list(got) == pytest.approx(lps)
    for s in samples:
        assert not s.sampler_logprobs[~s.train_mask].any()  # context carries no log-prob


# -- extend ------------------------------------------------------------------------------------------------------
def test_turns_that_extend_make_one_sample_with_every_output_trained_once():
    t1 = turn([1, 3, 4], [10, 11, EOS], 1)
    t2 = turn(t1.prompt_ids + t1.output_ids + [20, 21], [12, EOS], 2)  # a tool result, then the next reply
    t3 = turn(t2.prompt_ids + t2.output_ids + [22], [13, 14, EOS], 3)
    trace = trace_of(t1, t2, t3)
    rollout, [sample], stats = samples_of(trace)
    assert (stats.transitions, stats.forks, stats.drift_tokens) == (2, 0, [0, 0])
    assert sample.input_ids.tolist() == t3.prompt_ids + t3.output_ids
    mask = [False] * 3 + [True] * 3 + [False] * 2 + [True] * 2 + [False] + [True] * 3
    assert sample.train_mask.tolist() == mask  # prompt tails are context, outputs are trained
    assert_each_sampled_token_trained_once(trace, [sample])
    assert rollout.completion_ids == [10, 11, EOS, 12, EOS, 13, 14, EOS]
    assert rollout.turns == [t1, t2, t3]


def test_two_turns_extending_with_no_new_context():
    t1 = turn([1, 3], [10, 11], 1)  # cut at max_tokens: no eos
    t2 = turn(t1.prompt_ids + t1.output_ids, [12, EOS], 2)  # a continuation of the same text
    trace = trace_of(t1, t2)
    _, [sample], stats = samples_of(trace)
    assert stats.forks == 0 and sample.input_ids.tolist() == [1, 3, 10, 11, 12, EOS]
    assert_each_sampled_token_trained_once(trace, [sample])


def test_sampler_topk_follows_the_trained_tokens():
    t1 = turn([1, 3], [10, EOS], 1, topk=True)
    t2 = turn(t1.prompt_ids + t1.output_ids + [20], [12, EOS], 2, topk=True)
    _, [sample], _ = samples_of(trace_of(t1, t2), num_topk=2)
    topk = sample.token_extras[SAMPLER_TOPK]
    assert topk.ids.tolist() == [[10, 510], [EOS, EOS + 500], [12, 512], [EOS, EOS + 500]]
    assert topk.logprobs[:, 0] == pytest.approx([-0.1, -0.1, -0.2, -0.2])
    assert topk.logprobs[:, 1] == pytest.approx([-3.0] * 4)


# -- fork --------------------------------------------------------------------------------------------------------
def test_a_turn_that_rewrites_history_forks():
    t1 = turn([1, 3, 4], [10, 11, EOS], 1)
    rewritten = [1, 3, 4, 99, 11, EOS, 20]  # the agent edited the reply (or the template re-rendered it)
    t2 = turn(rewritten, [12, EOS], 2)
    trace = trace_of(t1, t2)
    _, (first, second), stats = samples_of(trace)
    assert (stats.transitions, stats.forks) == (1, 1)
    assert stats.drift_tokens == [3]  # of the 6 tokens kept, the first 3 were still a prefix
    assert first.input_ids.tolist() == t1.prompt_ids + t1.output_ids
    assert second.input_ids.tolist() == rewritten + [12, EOS]
    assert not second.train_mask[: len(rewritten)].any()  # the rewritten history is context, not retrained
    assert_each_sampled_token_trained_once(trace, [first, second])


def test_a_shorter_prompt_forks_and_a_later_turn_extends_the_fork():
    t1 = turn([1, 3, 4], [10, EOS], 1)
    t2 = turn([1, 3], [12, EOS], 2)  # the agent dropped its history: a prefix of what was kept
    t3 = turn(t2.prompt_ids + t2.output_ids + [21], [13, EOS], 3)
    trace = trace_of(t1, t2, t3)
    _, samples, stats = samples_of(trace)
    assert (stats.transitions, stats.forks) == (2, 1)
    assert [s.input_ids.tolist() for s in samples] == [[1, 3, 4, 10, EOS], [1, 3, 12, EOS, 21, 13, EOS]]
    assert_each_sampled_token_trained_once(trace, samples)


def test_two_independent_requests_are_two_samples():
    trace = trace_of(turn([1, 5], [10, EOS], 1), turn([7, 8, 9], [11, EOS], 2))
    _, samples, stats = samples_of(trace)
    assert len(samples) == 2 and stats.forks == 1
    assert_each_sampled_token_trained_once(trace, samples)


# -- turns with no sampled token ---------------------------------------------------------------------------------
def test_an_empty_turn_between_two_trains_nothing_and_keeps_one_sample():
    t1 = turn([1, 3], [10, EOS], 1)
    t2 = turn(t1.prompt_ids + t1.output_ids + [20], [], 2)  # answered with no token (e.g. no room left)
    t3 = turn(t2.prompt_ids + [21], [12, EOS], 3)
    trace = trace_of(t1, t2, t3)
    rollout, [sample], stats = samples_of(trace)
    assert stats.forks == 0
    assert sample.input_ids.tolist() == [1, 3, 10, EOS, 20, 21, 12, EOS]
    assert_each_sampled_token_trained_once(trace, [sample])
    assert rollout.completion_ids == [10, EOS, 12, EOS]


def test_a_rollout_whose_only_turn_is_empty_yields_no_sample():
    rollout, samples, stats = samples_of(trace_of(turn([1, 3, 4], [], 1)))
    assert samples == [] and stats.transitions == 0
    assert rollout.completion_ids == [] and len(rollout.turns) == 1


def test_an_empty_turn_that_forks_leaves_no_empty_sample():
    t1 = turn([1, 3, 4], [], 1)
    t2 = turn([1, 5], [12, EOS], 2)
    trace = trace_of(t1, t2)
    _, [sample], stats = samples_of(trace)
    assert stats.forks == 1 and sample.input_ids.tolist() == [1, 5, 12, EOS]
    assert_each_sampled_token_trained_once(trace, [sample])


def test_an_empty_last_turn_after_a_fork():
    t1 = turn([1, 3], [10, EOS], 1)
    t2 = turn([7], [], 2)
    trace = trace_of(t1, t2)
    _, [sample], _ = samples_of(trace)
    assert sample.input_ids.tolist() == [1, 3, 10, EOS]
    assert_each_sampled_token_trained_once(trace, [sample])


# -- what reward functions see -----------------------------------------------------------------------------------
USER = {"role": "user", "content": "What is 3 times 4?"}
SYSTEM = {"role": "system", "content": "Use the tools."}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "multiply", "arguments": '{"a": 3, "b": 4}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "12"}
ANSWER = {"role": "assistant", "content": "It is 12."}


def test_chat_prompt_is_the_first_request_and_completion_what_the_last_added():
    trace = Trace(token="agrpo-test")
    first = [SYSTEM, USER]
    t1 = turn([1, 3], [10, EOS], 1)
    trace.record_chat(t1, first, CALLED, "<tool_call>...</tool_call>")
    t2 = turn(t1.prompt_ids + t1.output_ids + [20], [12, EOS], 2)
    trace.record_chat(t2, [*first, CALLED, RESULT], ANSWER, "It is 12.")
    rollout = trace_rollout(trace)
    assert rollout.prompt == first
    called = {
        **CALLED,
        "tool_calls": [
            {**CALLED["tool_calls"][0], "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
        ],
    }
    assert rollout.completion == [called, RESULT, ANSWER]  # arguments as data, as in tool-loop completions
    assert (
        CALLED["tool_calls"][0]["function"]["arguments"] == '{"a": 3, "b": 4}'
    )  # the trace's copy untouched
    assert rollout.completion_ids == [10, EOS, 12, EOS]
    assert (rollout.reward, rollout.unscored) == (None, None)  # the runner's to set


def test_one_chat_request():
    trace = Trace(token="agrpo-test")
    trace.record_chat(turn([1], [12, EOS], 1), [USER], ANSWER, "It is 12.")
    rollout = trace_rollout(trace)
    assert (rollout.prompt, rollout.completion) == ([USER], [ANSWER])


def test_a_last_request_that_drops_the_first_messages_is_the_whole_completion():
    trace = Trace(token="agrpo-test")
    trace.record_chat(turn([1], [10, EOS], 1), [SYSTEM, USER], CALLED, "call")
    summary = {"role": "user", "content": "Earlier you found 12. Answer."}
    trace.record_chat(turn([4], [12, EOS], 2), [summary], ANSWER, "It is 12.")
    rollout = trace_rollout(trace)
    assert rollout.prompt == [SYSTEM, USER]
    assert rollout.completion == [summary, ANSWER]


def test_completions_only_gets_the_rows_prompt_and_the_last_text():
    trace = Trace(token="agrpo-test")
    trace.record_completion(turn([1, 3], [10, 11], 1), " first draft")
    trace.record_completion(turn([1, 3, 10, 11], [12, EOS], 2), " twelve")
    rollout = trace_rollout(trace)
    assert rollout.prompt is None  # None: the row's prompt
    assert rollout.completion == [{"role": "assistant", "content": " twelve"}]
    assert rollout.completion_ids == [10, 11, 12, EOS]
    _, [sample], _ = samples_of(trace)
    assert trained(sample) == [10, 11, 12, EOS]


def test_chat_and_completions_mixed_reports_the_chat_conversation():
    trace = Trace(token="agrpo-test")
    trace.record_completion(turn([1], [10, EOS], 1), "a plan")
    trace.record_chat(turn([5], [12, EOS], 2), [USER], ANSWER, "It is 12.")
    rollout = trace_rollout(trace)
    assert (rollout.prompt, rollout.completion) == ([USER], [ANSWER])
    assert rollout.completion_ids == [10, EOS, 12, EOS]


def test_no_request_at_all_is_an_empty_rollout():
    rollout = trace_rollout(Trace(token="agrpo-test"))
    assert (rollout.prompt, rollout.completion, rollout.completion_ids, rollout.turns) == (None, [], [], [])
    samples, stats = rollout_to_sequences(rollout, num_topk=0)
    assert samples == [] and stats.transitions == 0


# -- the trace's own bookkeeping ---------------------------------------------------------------------------------
def test_replies_are_remembered_by_their_key_as_sampled_text():
    trace = Trace(token="agrpo-test")
    raw = 'Let me multiply.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    answered = {**CALLED, "content": "Let me multiply."}
    trace.record_chat(turn([1], [10, EOS], 1), [USER], answered, raw)
    resent = {
        "role": "assistant",
        "content": "Let me multiply.",
        "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "multiply", "arguments": '{"b":4,"a":3}'}}
        ],
    }
    assert trace.raw_text(resent, {}) == raw
    assert trace.raw_text({**resent, "role": "user"}, {}) is None  # only assistant messages are replies
    assert trace.raw_text({**resent, "content": "Let me add."}, {}) is None  # an edit is not the reply
    assert set(trace.replies) == {api.reply_key(answered)}


def test_close_cancels_requests_in_flight_and_counts_them():
    async def scenario() -> tuple[int, Trace, asyncio.Task, asyncio.Task]:
        trace = Trace(token="agrpo-test")
        pending = asyncio.create_task(asyncio.sleep(30))
        finished = asyncio.create_task(asyncio.sleep(0))
        await finished
        trace.inflight |= {pending, finished}
        late = trace.close()
        await asyncio.sleep(0)
        return late, trace, pending, finished

    late, trace, pending, finished = asyncio.run(scenario())
    assert late == 1 and trace.late_requests == 1 and trace.closed
    assert pending.cancelled() and not finished.cancelled()
