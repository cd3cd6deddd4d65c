"""Reconciliation of rollouts whose agent runs several conversations at once (``rollout/sequences.py``).

Boundary: ``rollout_to_sequences`` on hand-written ``TurnRecord`` lists (every open sample is a candidate: a turn
extends the longest one that is a prefix of its prompt, the most recent on a tie, else forks), a seeded comparison
with the one-open-sample rule on single-conversation traces (the tool loop's: unchanged numbers), and one trace
recorded by the real proxy (``tests/helpers/harness_policy.py``) from two sub-agents talking through the ``openai``
client, interleaved.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from openai import OpenAI

from asyncgrpo_cli.rollout.harness.trace import trace_rollout
from asyncgrpo_cli.rollout.sequences import common_prefix_len, rollout_to_sequences
from asyncgrpo_cli.samples import SAMPLER_TOPK, CandidateSets, Rollout, TurnRecord
from tests.helpers.fake_server import token_logprob
from tests.helpers.harness_policy import ProxyRig, Replies, training_tokenizer


def turn(prompt, out, lp=-0.5, **kw) -> TurnRecord:
    return TurnRecord(list(prompt), list(out), [lp] * len(out), finish_reason="stop", **kw)


def rollout(*turns: TurnRecord) -> Rollout:
    return Rollout(completion=[], completion_ids=[t for x in turns for t in x.output_ids], turns=list(turns))


def trained(sample) -> list[int]:
    return sample.input_ids[sample.train_mask].tolist()


def layout(sample) -> tuple[list[int], list[int]]:
    return sample.input_ids.tolist(), sample.train_mask.astype(int).tolist()


SYS = [1, 2]  # a system prompt both sub-agents share


# -- interleaved conversations ------------------------------------------------------------------------------------
def test_two_interleaved_conversations_give_one_sample_each():
    a1 = turn([*SYS, 3], [10, 11], -0.1, output_sampler_logprobs=[{10: -0.1, 7: -2.0}, {11: -0.1}])
    b1 = turn([*SYS, 4], [20, 21], -0.2, output_sampler_logprobs=[{20: -0.2}, {21: -0.2, 8: -3.0}])
    a2 = turn([*SYS, 3, 10, 11, 5], [12], -0.3, output_sampler_logprobs=[{12: -0.3}])
    b2 = turn([*SYS, 4, 20, 21, 6, 6], [22], -0.4, output_sampler_logprobs=[{22: -0.4, 9: -1.0}])
    r = rollout(a1, b1, a2, b2)
    (a, b), stats = rollout_to_sequences(r, num_topk=2)
    assert layout(a) == ([1, 2, 3, 10, 11, 5, 12], [0, 0, 0, 1, 1, 0, 1])
    assert layout(b) == ([1, 2, 4, 20, 21, 6, 6, 22], [0, 0, 0, 1, 1, 0, 0, 1])
    np.testing.assert_allclose(a.sampler_logprobs[a.train_mask], [-0.1, -0.1, -0.3], atol=1e-7)
    np.testing.assert_allclose(b.sampler_logprobs[b.train_mask], [-0.2, -0.2, -0.4], atol=1e-7)
    assert not a.sampler_logprobs[~a.train_mask].any() and not b.sampler_logprobs[~b.train_mask].any()
    assert a.token_extras[SAMPLER_TOPK].ids.tolist() == [[10, 7], [11, -1], [12, -1]]
    assert b.token_extras[SAMPLER_TOPK].ids.tolist() == [[20, -1], [21, 8], [22, 9]]
    assert a.rollout_id == b.rollout_id == r.rollout_id
    # B1 is the one fork (A's 5 kept ids share 2 with its prompt); A2 and B2 extend
    assert (stats.transitions, stats.forks, stats.drift_tokens) == (3, 1, [3, 0, 0])


def test_three_interleaved_conversations_are_emitted_in_creation_order():
    a, b, c = [*SYS, 3], [*SYS, 4], [*SYS, 5]
    turns = [
        turn(a, [10]),
        turn(b, [20]),
        turn(c, [30]),
        turn([*c, 30, 7], [31]),  # C moves first
        turn([*a, 10, 7], [11]),
        turn([*b, 20, 7], [21]),
        turn([*b, 20, 7, 21, 8], [22]),  # B twice in a row
        turn([*a, 10, 7, 11, 8], [12]),
        turn([*c, 30, 7, 31, 8], [32]),
    ]
    samples, stats = rollout_to_sequences(rollout(*turns), num_topk=0)
    assert [trained(s) for s in samples] == [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    assert samples[2].input_ids.tolist() == [*c, 30, 7, 31, 8, 32]
    assert (stats.transitions, stats.forks) == (8, 2)
    assert stats.drift_tokens == [2, 2, 0, 0, 0, 0, 0, 0]


def test_a_rewritten_history_forks_a_while_b_stays_open():
    a1 = turn([*SYS, 3], [10, 11])
    b1 = turn([*SYS, 4], [20])
    a2 = turn([*SYS, 3, 99, 5], [12])  # A's agent rewrote its reply (99): A forks into A'
    b2 = turn([*SYS, 4, 20, 6], [21])  # B still extends its own sample
    a3 = turn([*SYS, 3, 99, 5, 12, 5], [13])  # extends A', not the abandoned A
    (a, b, a_new), stats = rollout_to_sequences(rollout(a1, b1, a2, b2, a3), num_topk=0)
    assert [trained(s) for s in (a, b, a_new)] == [[10, 11], [20, 21], [12, 13]]
    assert layout(a_new) == ([1, 2, 3, 99, 5, 12, 5, 13], [0, 0, 0, 0, 0, 1, 0, 1])
    assert layout(b) == ([1, 2, 4, 20, 6, 21], [0, 0, 0, 1, 0, 1])
    # A2's drift is measured against the previous turn's sample (B: 4 kept ids, 2 shared)
    assert (stats.forks, stats.drift_tokens) == (2, [3, 2, 0, 0])


def test_a_tie_goes_to_the_most_recent_sample():
    x = turn([*SYS], [10, 11])
    y = turn([*SYS, 10], [11])  # X's ids are not a prefix of its prompt: a fork, with the same ids as X
    z = turn([7], [8])  # an unrelated conversation, created after both
    nxt = turn([*SYS, 10, 11, 5], [12])  # X and Y both prefix it, equally long: Y, the more recent
    samples, stats = rollout_to_sequences(rollout(x, y, z, nxt), num_topk=0)
    assert [trained(s) for s in samples] == [[10, 11], [11, 12], [8]]
    assert stats.drift_tokens == [1, 4, 0]


def test_the_longest_prefix_wins_over_the_most_recent():
    long = turn([*SYS], [9, 3])  # ids 1 2 9 3
    short = turn([1], [2])  # a fork; ids 1 2, a prefix of the first sample, and more recent
    deeper = turn([*SYS, 9, 3, 5], [6])  # both prefix it: the longer one takes it
    other = turn([*SYS, 7], [8])  # only the short one prefixes it
    samples, stats = rollout_to_sequences(rollout(long, short, deeper, other), num_topk=0)
    assert [layout(s) for s in samples] == [
        ([1, 2, 9, 3, 5, 6], [0, 0, 1, 1, 0, 1]),
        ([1, 2, 7, 8], [0, 1, 0, 1]),
    ]
    assert (stats.forks, stats.drift_tokens) == (1, [3, 0, 0])


def test_masks_and_sets_follow_their_own_conversation():
    a1 = turn([*SYS, 3], [10, 11, 12], output_mask=[1, 0, 1], output_sampling_mask=[[10, 4], [11], [12, 5]])
    b1 = turn([*SYS, 4], [20], output_sampling_mask=CandidateSets.from_lists([[20, 6, 7]]))
    a2 = turn([*SYS, 3, 10, 11, 12, 5], [13])  # no sets recorded
    b2 = turn([*SYS, 4, 20, 5], [21], output_mask=[0])  # nothing trained: context only
    (a, b), _ = rollout_to_sequences(rollout(a1, b1, a2, b2), num_topk=0)
    assert layout(a) == ([1, 2, 3, 10, 11, 12, 5, 13], [0, 0, 0, 1, 0, 1, 0, 1])
    assert a.sampling_mask.to_lists() == [[10, 4], [12, 5], []]
    assert layout(b) == ([1, 2, 4, 20, 5, 21], [0, 0, 0, 1, 0, 0])
    assert b.sampling_mask.to_lists() == [[20, 6, 7]]
    # a conversation that trained nothing is no sample; the other one's turns still extend
    c1 = turn([8], [30], output_mask=[0])
    d1 = turn([9], [40])
    c2 = turn([8, 30, 5], [31], output_mask=[0])
    d2 = turn([9, 40, 5], [41])
    [d], stats = rollout_to_sequences(rollout(c1, d1, c2, d2), num_topk=0)
    assert layout(d) == ([9, 40, 5, 41], [0, 1, 0, 1]) and stats.forks == 1


# -- one conversation: the rule of one open sample, unchanged -----------------------------------------------------
def one_open_sample(turns: list[TurnRecord]) -> tuple[list[tuple[list[int], list[int]]], int, list[int]]:
    """The rule before several samples stayed open: (ids, mask) of each sample, forks, drift_tokens."""
    samples: list[tuple[list[int], list[int]]] = []
    forks, drift = 0, []
    for i, t in enumerate(turns):
        ids, mask = samples[-1] if samples else ([], [])
        if i and len(t.prompt_ids) >= len(ids) and t.prompt_ids[: len(ids)] == ids:
            drift.append(0)
        else:
            if i:
                forks += 1
                drift.append(len(ids) - common_prefix_len(ids, t.prompt_ids))
            ids, mask = [], []
            samples.append((ids, mask))
        mask += [0] * (len(t.prompt_ids) - len(ids)) + [1] * len(t.output_ids)
        ids[:] = [*t.prompt_ids, *t.output_ids]
    return samples, forks, drift


def single_conversation(rng: random.Random) -> list[TurnRecord]:
    """A tool loop's turns: each prompt is everything so far plus a tool result, or that history re-rendered with
    a token changed (fresh ids, so a rewritten prompt never matches an earlier sample again)."""
    fresh = iter(range(1000, 10**6))
    kept = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
    turns = []
    for _ in range(rng.randrange(1, 12)):
        prompt = list(kept)
        if turns and rng.random() < 0.3:
            prompt[rng.randrange(len(prompt))] = next(fresh)
        prompt += [rng.randrange(50) for _ in range(rng.randrange(0, 4))]
        out = [rng.randrange(50) for _ in range(rng.randrange(1, 5))]
        turns.append(turn(prompt, out))
        kept = prompt + out
    return turns


def test_single_conversations_give_the_one_open_sample_numbers():
    rng = random.Random(0)
    seen_forks = 0
    for _ in range(300):
        turns = single_conversation(rng)
        samples, stats = rollout_to_sequences(rollout(*turns), num_topk=0)
        expected, forks, drift = one_open_sample(turns)
        assert [layout(s) for s in samples] == expected
        assert (stats.transitions, stats.forks, stats.drift_tokens) == (len(turns) - 1, forks, drift)
        seen_forks += forks
    assert seen_forks > 50  # the traces do fork


# -- through the proxy --------------------------------------------------------------------------------------------
@pytest.fixture
def rig():
    tok = training_tokenizer()
    rig = ProxyRig(tok, Replies(tok, ["Ask B.", "Four.", "B says four.", "Done."])).start()
    yield rig
    rig.stop()


def test_two_sub_agents_through_the_proxy_give_two_samples(rig):
    trace = rig.open()
    client = OpenAI(base_url=rig.base_url, api_key=trace.token, max_retries=0, timeout=30.0)

    def ask(history):
        reply = client.chat.completions.create(model="m", messages=history).choices[0].message
        return [*history, reply.model_dump(exclude_none=True)]

    a = ask([{"role": "system", "content": "You plan."}, {"role": "user", "content": "What is 2 plus 2?"}])
    b = ask([{"role": "system", "content": "You compute."}, {"role": "user", "content": "2 plus 2"}])
    ask([*a, {"role": "user", "content": "B answered: Four."}])
    ask([*b, {"role": "user", "content": "Thanks."}])

    a1, b1, a2, b2 = trace.turns
    samples, stats = rollout_to_sequences(trace_rollout(trace), num_topk=0)
    assert (stats.transitions, stats.forks) == (3, 1)
    assert [trained(s) for s in samples] == [a1.output_ids + a2.output_ids, b1.output_ids + b2.output_ids]
    assert [s.input_ids.tolist() for s in samples] == [
        a2.prompt_ids + a2.output_ids,
        b2.prompt_ids + b2.output_ids,
    ]
    for s in samples:
        assert s.sampler_logprobs[s.train_mask] == pytest.approx([token_logprob(t) for t in trained(s)])
