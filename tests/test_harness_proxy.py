"""The recording proxy's OpenAI shapes (``rollout/harness/proxy.py``, ``openai_api.py``), driven by the ``openai``
client package over real HTTP.

Boundary: the proxy is built as the rollout process builds it (``build_harness``: the tiny tokenizer with the
ChatML training template, the Hermes tool-call parser) and samples through a real ``CompletionClient`` against a
scripted ``FakeVllmServer`` (``tests/helpers/harness_policy.py``); nothing is mocked between the client and the
fake. Each test scripts the fake's replies (token ids of known text, eos when it stopped) and checks the answers
against OpenAI's published shapes, what the proxy recorded in the rollout's trace, and what that trace trains
(``trace_rollout`` -> ``rollout_to_sequences``). Refusals are checked through the errors the ``openai`` client
raises (status, ``error.param``, ``error.code``) and the proxy's counters. The end of the file unit-tests pure
``openai_api`` functions.
"""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
from openai import OpenAI

from asyncgrpo_cli.rollout.agent.tool_calls import ParsedReply, ToolCall
from asyncgrpo_cli.rollout.harness import openai_answers as answers
from asyncgrpo_cli.rollout.harness import openai_api as api
from asyncgrpo_cli.rollout.harness.trace import trace_rollout
from asyncgrpo_cli.rollout.sequences import rollout_to_sequences
from tests.helpers.fake_server import token_logprob
from tests.helpers.harness_policy import (
    MAX_COMPLETION_LENGTH,
    SERVED_MODEL,
    TEMPERATURE,
    ProxyRig,
    Replies,
    training_tokenizer,
)

QUESTION = [{"role": "user", "content": "What is 3 times 4?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


CALL = call("multiply", a=3, b=4)


@pytest.fixture(scope="module")
def tok():
    return training_tokenizer()


@pytest.fixture
def make_rig(tok):
    """``make_rig(replies, **kw)`` -> a started ``ProxyRig`` whose fake answers ``replies`` in order."""
    rigs: list[ProxyRig] = []

    def make(replies, **kw) -> ProxyRig:
        rig = ProxyRig(tok, Replies(tok, replies), **kw)
        rigs.append(rig)
        return rig.start()

    yield make
    for rig in rigs:
        rig.stop()


@pytest.fixture(scope="module")
def idle_rig(tok):
    """One rig for the tests whose requests never reach the fake (refusals): it has no reply to give."""
    rig = ProxyRig(tok, Replies(tok, [])).start()
    yield rig
    rig.stop()


def rejected(rig: ProxyRig) -> float:
    return rig.counts().get("harness/rejected_request_count", 0)


def client_for(rig: ProxyRig, token: str) -> OpenAI:
    return OpenAI(base_url=rig.base_url, api_key=token, max_retries=0, timeout=30.0)


def opened(rig: ProxyRig):
    trace = rig.open()
    return trace, client_for(rig, trace.token)


def ids_of(tok, text: str) -> list[int]:
    """The ids the fake sends for a scripted text reply (it stopped: eos last)."""
    return tok.encode(text) + [tok.eos_token_id]


# -- routes and shapes -------------------------------------------------------------------------------------------
def test_models_lists_the_served_model(idle_rig):
    _, client = opened(idle_rig)
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED_MODEL]
    assert models.data[0].object == "model"


def test_chat_without_tools(make_rig, tok):
    rig = make_rig(["It is 12."])
    trace, client = opened(rig)
    r = client.chat.completions.create(model="my-agent-model", messages=QUESTION)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "my-agent-model"  # the request's model name is echoed
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert (choice.index, choice.finish_reason, choice.logprobs) == (0, "stop", None)
    assert choice.message.role == "assistant"
    assert choice.message.content == "It is 12." and choice.message.tool_calls is None
    # what was sampled: the rendered conversation, with the generation prompt and no tool block
    prompt = rig.render(QUESTION)
    assert rig.fake.completion_prompts == [prompt]
    assert tok.decode(prompt).endswith(
        "<|im_start|>user\nWhat is 3 times 4?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<tools>" not in tok.decode(prompt)
    out = ids_of(tok, "It is 12.")
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(out)
    assert r.usage.total_tokens == len(prompt) + len(out)
    # what was recorded
    [turn] = trace.turns
    assert (turn.prompt_ids, turn.output_ids) == (prompt, out)
    assert turn.output_log_probs == pytest.approx([token_logprob(t) for t in out])
    rollout = trace_rollout(trace)
    assert rollout.prompt == QUESTION
    assert rollout.completion == [{"role": "assistant", "content": "It is 12."}]
    assert rollout.completion_ids == out


def test_without_tools_call_markup_is_plain_content(make_rig):
    rig = make_rig(["Maybe " + CALL])
    _, client = opened(rig)
    message = client.chat.completions.create(model="m", messages=QUESTION).choices[0].message
    assert message.content == "Maybe " + CALL and message.tool_calls is None


def test_chat_with_tools_answers_tool_calls(make_rig, tok):
    rig = make_rig([CALL])
    trace, client = opened(rig)
    r = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None  # the reply is only the call
    [tc] = choice.message.tool_calls
    assert tc.id.startswith("call_") and tc.type == "function"
    assert tc.function.name == "multiply"
    assert isinstance(tc.function.arguments, str) and json.loads(tc.function.arguments) == {"a": 3, "b": 4}
    prompt = tok.decode(trace.turns[0].prompt_ids)
    assert "<tools>" in prompt and '"name": "multiply"' in prompt  # the schema reached the template
    assert trace.turns[0].output_ids == ids_of(tok, CALL)


def test_two_calls_in_one_reply_get_their_own_ids(make_rig):
    rig = make_rig(["Both:\n" + CALL + "\n" + call("multiply", a=5, b=6)])
    _, client = opened(rig)
    message = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS).choices[0].message
    assert message.content == "Both:"
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [
        {"a": 3, "b": 4},
        {"a": 5, "b": 6},
    ]
    assert len({c.id for c in message.tool_calls}) == 2


def resend_as_returned(message) -> dict:
    return message.model_dump(exclude_none=True)


def resend_object(message):
    return message  # the pydantic object itself, as many agents append it


def resend_rewritten(message) -> dict:
    """What a client that rebuilds the message sends: new call ids, arguments re-serialized, content ''."""
    calls = [
        {
            "id": f"my-own-id-{j}",
            "type": "function",
            "function": {
                "name": c.function.name,
                "arguments": json.dumps(
                    json.loads(c.function.arguments), separators=(",", ":"), sort_keys=True
                ),
            },
        }
        for j, c in enumerate(message.tool_calls)
    ]
    return {"role": "assistant", "content": "", "tool_calls": calls}


@pytest.mark.parametrize("resend", [resend_as_returned, resend_object, resend_rewritten])
def test_a_reply_sent_back_is_rendered_as_sampled_and_the_sample_extends(make_rig, tok, resend):
    rig = make_rig([CALL, "It is 12."])
    trace, client = opened(rig)
    first = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS).choices[0].message
    tool_message = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "12"}
    history = [*QUESTION, resend(first), tool_message]
    second = client.chat.completions.create(model="m", messages=history, tools=TOOLS).choices[0]
    assert (second.message.content, second.finish_reason) == ("It is 12.", "stop")

    t1, t2 = trace.turns
    kept = t1.prompt_ids + t1.output_ids
    assert t2.prompt_ids[: len(kept)] == kept  # the raw sampled text, eos included, is the history
    assert (
        tok.decode(t2.prompt_ids[len(kept) :]) == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    )

    rollout = trace_rollout(trace)
    [sample], stats = rollout_to_sequences(rollout, num_topk=0)
    assert (stats.transitions, stats.forks) == (1, 0)
    assert sample.input_ids.tolist() == t2.prompt_ids + t2.output_ids
    trained = sample.input_ids[sample.train_mask].tolist()
    assert trained == t1.output_ids + t2.output_ids  # both turns trained, each token once
    assert sample.sampler_logprobs[sample.train_mask] == pytest.approx([token_logprob(t) for t in trained])
    assert not sample.train_mask[: len(t1.prompt_ids)].any()
    assert not sample.train_mask[len(kept) : len(t2.prompt_ids)].any()  # the tool result is context
    # what reward functions see: the first request's messages, then the agent's final conversation
    assert rollout.prompt == QUESTION
    assert [m["role"] for m in rollout.completion] == ["assistant", "tool", "assistant"]
    assert rollout.completion[-1] == {"role": "assistant", "content": "It is 12."}
    assert rollout.completion_ids == t1.output_ids + t2.output_ids


def test_a_reply_cut_at_max_tokens_sent_back_still_extends(make_rig, tok):
    rig = make_rig(["It is twelve, because 3 times 4 is 12.", "Done."])
    trace, client = opened(rig)
    first = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=3).choices[0]
    assert first.finish_reason == "length"
    history = [*QUESTION, first.message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="m", messages=history)
    t1, t2 = trace.turns
    kept = t1.prompt_ids + t1.output_ids
    assert len(t1.output_ids) == 3 and t2.prompt_ids[: len(kept)] == kept
    assert t2.prompt_ids[len(kept)] == tok.eos_token_id  # the end of turn the template adds is context
    [sample], _ = rollout_to_sequences(trace_rollout(trace), num_topk=0)
    assert sample.input_ids[sample.train_mask].tolist() == t1.output_ids + t2.output_ids


def test_an_edited_reply_is_rendered_as_edited_and_forks(make_rig, tok):
    rig = make_rig(["Let me multiply.\n" + CALL, "It is 12."])
    trace, client = opened(rig)
    first = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS).choices[0].message
    edited = {**first.model_dump(exclude_none=True), "content": "I will multiply."}
    history = [*QUESTION, edited, {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "12"}]
    client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    t1, t2 = trace.turns
    assert "I will multiply." in tok.decode(t2.prompt_ids)  # the edit, not the sampled text
    samples, stats = rollout_to_sequences(trace_rollout(trace), num_topk=0)
    assert stats.forks == 1 and len(samples) == 2
    assert [s.input_ids[s.train_mask].tolist() for s in samples] == [t1.output_ids, t2.output_ids]


def test_a_reply_without_sampled_tokens(make_rig):
    rig = make_rig([[]])
    trace, client = opened(rig)
    r = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)
    assert r.choices[0].message.content == "" and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0
    [turn] = trace.turns
    assert turn.output_ids == []
    samples, _ = rollout_to_sequences(trace_rollout(trace), num_topk=0)
    assert samples == []  # nothing was sampled: nothing to train


def test_settings_that_match_the_run_are_accepted_and_max_tokens_is_capped(make_rig):
    rig = make_rig(["a", "b"])
    _, client = opened(rig)
    client.chat.completions.create(
        model="m",
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=True,
        max_tokens=10_000,  # beyond sampling.max_completion_length: cut there
        temperature=TEMPERATURE,
        top_p=1.0,
        n=1,
        presence_penalty=0,
        frequency_penalty=0,
        response_format={"type": "text"},
        seed=7,
        user="someone",
        metadata={"k": "v"},
        extra_body={"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "an_unknown_extra": True},
    )
    client.chat.completions.create(model="m", messages=QUESTION, max_completion_tokens=5)
    assert [n for _, n in rig.fake.reply.requests] == [MAX_COMPLETION_LENGTH, 5]
    assert rig.counts().get("harness/rejected_request_count", 0) == 0


# -- streaming ---------------------------------------------------------------------------------------------------
def reassemble(chunks) -> tuple[dict, list[str]]:
    """A streamed chat answer put back together as a client does: the message, and the finish reasons seen."""
    content, calls, reasons = "", {}, []
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "type": "function", "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        if c.choices[0].finish_reason:
            reasons.append(c.choices[0].finish_reason)
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [
            {"id": e["id"], "type": e["type"], "function": {"name": e["name"], "arguments": e["arguments"]}}
            for _, e in sorted(calls.items())
        ]
    return message, reasons


def test_streamed_chat_reassembles_to_the_answer_and_its_resend_extends(make_rig):
    rig = make_rig(["Let me multiply.\n" + CALL, "It is 12."])
    trace, client = opened(rig)
    chunks = list(
        client.chat.completions.create(
            model="m", messages=QUESTION, tools=TOOLS, stream=True, stream_options={"include_usage": True}
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    message, reasons = reassemble(chunks)
    assert message["content"] == "Let me multiply." and reasons == ["tool_calls"]
    [tc] = message["tool_calls"]
    assert tc["id"].startswith("call_") and tc["function"]["name"] == "multiply"
    assert json.loads(tc["function"]["arguments"]) == {"a": 3, "b": 4}
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == len(trace.turns[0].output_ids)
    assert usage.usage.prompt_tokens == len(trace.turns[0].prompt_ids)
    # a streaming agent sends back what it reassembled: still the sampled text
    history = [*QUESTION, message, {"role": "tool", "tool_call_id": tc["id"], "content": "12"}]
    second, _ = reassemble(
        client.chat.completions.create(model="m", messages=history, tools=TOOLS, stream=True)
    )
    assert second == {"role": "assistant", "content": "It is 12."}
    [sample], stats = rollout_to_sequences(trace_rollout(trace), num_topk=0)
    assert stats.forks == 0
    assert (
        sample.input_ids[sample.train_mask].tolist() == trace.turns[0].output_ids + trace.turns[1].output_ids
    )


def test_streamed_chat_without_usage_has_none(make_rig):
    rig = make_rig(["It is 12."])
    _, client = opened(rig)
    chunks = list(client.chat.completions.create(model="m", messages=QUESTION, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "It is 12."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streamed_completion(make_rig, tok):
    rig = make_rig([" twelve"])
    trace, client = opened(rig)
    chunks = list(
        client.completions.create(
            model="m", prompt="3 times 4 is", stream=True, stream_options={"include_usage": True}
        )
    )
    assert {c.object for c in chunks} == {"text_completion"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " twelve"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(ids_of(tok, " twelve")) == len(trace.turns[0].output_ids)


# -- log-probs ---------------------------------------------------------------------------------------------------
def test_chat_logprobs_are_the_samplers(make_rig, tok):
    rig = make_rig(["It is 12.", "It is 12."], num_topk=3)
    _, client = opened(rig)
    out = ids_of(tok, "It is 12.")
    r = client.chat.completions.create(model="m", messages=QUESTION, logprobs=True, top_logprobs=2)
    entries = r.choices[0].logprobs.content
    assert [e.token for e in entries] == [tok.decode([t]) for t in out]
    assert [e.logprob for e in entries] == pytest.approx([token_logprob(t) for t in out])
    for e in entries:
        assert e.bytes == list(e.token.encode("utf-8"))
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    # logprobs without top_logprobs: the sampled tokens only
    r = client.chat.completions.create(model="m", messages=QUESTION, logprobs=True)
    assert [e.top_logprobs for e in r.choices[0].logprobs.content] == [[]] * len(out)


# -- /v1/completions ---------------------------------------------------------------------------------------------
def test_completion_with_a_string_prompt(make_rig, tok):
    rig = make_rig([" twelve"], num_topk=2)
    trace, client = opened(rig)
    r = client.completions.create(model="base", prompt="3 times 4 is", logprobs=2)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "base"
    [choice] = r.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, " twelve", "stop")
    prompt = [int(t) for t in tok("3 times 4 is")["input_ids"]]
    out = ids_of(tok, " twelve")
    assert rig.fake.completion_prompts == [prompt]
    assert (trace.turns[0].prompt_ids, trace.turns[0].output_ids) == (prompt, out)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(out))
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in out]
    assert lp.token_logprobs == pytest.approx([token_logprob(t) for t in out])
    assert [len(top) for top in lp.top_logprobs] == [2] * len(out)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    rollout = trace_rollout(trace)
    assert rollout.prompt is None  # the row's prompt
    assert rollout.completion == [{"role": "assistant", "content": " twelve"}]


def test_completion_with_token_ids(make_rig, tok):
    rig = make_rig([" twelve"])
    trace, client = opened(rig)
    prompt = tok.encode("3 times 4 is")
    r = client.completions.create(model="m", prompt=prompt)
    assert r.choices[0].text == " twelve" and r.choices[0].logprobs is None
    assert rig.fake.completion_prompts == [prompt] and trace.turns[0].prompt_ids == prompt
    [sample], _ = rollout_to_sequences(trace_rollout(trace), num_topk=0)
    assert sample.input_ids[sample.train_mask].tolist() == ids_of(tok, " twelve")


# -- refusals ----------------------------------------------------------------------------------------------------
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
REFUSED = [
    ("n", {"n": 2}, "n"),
    ("temperature", {"temperature": 0.7}, "temperature"),
    ("top_p", {"top_p": 0.9}, "top_p"),
    ("logit_bias", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("stop", {"stop": ["\n"]}, "stop"),
    ("presence_penalty", {"presence_penalty": 0.5}, "presence_penalty"),
    ("tool_choice", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    (
        "named tool_choice",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "multiply"}}},
        "tool_choice",
    ),
    ("response_format", {"response_format": {"type": "json_object"}}, "response_format"),
    (
        "image",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}]},
        "messages[0].content[1].type",
    ),
    ("max_tokens", {"max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("fields,param", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_request_that_cannot_be_served_faithfully_gets_400_naming_the_field(idle_rig, fields, param):
    rig = idle_rig
    trace, client = opened(rig)
    before = rejected(rig)
    body = {"model": "m", "messages": QUESTION, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    e = info.value
    assert e.status_code == 400 and e.body["type"] == "invalid_request_error"
    assert e.body["param"] == e.param == param
    assert param.split(".")[0].split("[")[0] in e.body["message"]
    assert trace.turns == [] and rig.fake.completion_prompts == []  # nothing was sampled
    assert rejected(rig) == before + 1


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"n": 2}, "n"),
        ({"echo": True}, "echo"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
    ],
    ids=["n", "echo", "batch", "logprobs"],
)
def test_a_completion_that_cannot_be_served_faithfully_gets_400(idle_rig, fields, param):
    rig = idle_rig
    _, client = opened(rig)
    before = rejected(rig)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**{"model": "m", "prompt": "3 times 4 is", **fields})
    assert info.value.status_code == 400 and info.value.body["param"] == param
    assert rejected(rig) == before + 1 and rig.fake.completion_prompts == []


def test_a_prompt_beyond_max_model_len_gets_context_length_exceeded(make_rig, tok):
    max_model_len = 160
    rig = make_rig(["ok", "ok"], max_model_len=max_model_len)
    trace, client = opened(rig)
    room = max_model_len - len(rig.render(QUESTION))
    assert 0 < room < MAX_COMPLETION_LENGTH
    # without max_tokens the reply may use the room left
    client.chat.completions.create(model="m", messages=QUESTION)
    # an explicit max_tokens that fits is served as asked
    client.chat.completions.create(model="m", messages=QUESTION, max_tokens=room)
    assert [n for _, n in rig.fake.reply.requests] == [room, room]
    # ... one that does not fit, and a prompt that does not fit at all, are refused as vLLM refuses them
    long = [{"role": "user", "content": "word " * max_model_len}]
    for messages, extra in ((QUESTION, {"max_tokens": room + 1}), (long, {})):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=messages, **extra)
        assert info.value.body["code"] == "context_length_exceeded"
        assert info.value.body["param"] == "messages"
        assert str(max_model_len) in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt=tok.encode("word " * max_model_len))
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "prompt"
    assert len(trace.turns) == 2 and len(rig.fake.completion_prompts) == 2
    counts = rig.counts()
    assert counts["harness/rejected_request_count"] == 3
    assert counts["rollout/max_model_len_stop_count"] == 3


# -- authentication ----------------------------------------------------------------------------------------------
def test_unknown_and_expired_tokens_get_401_and_are_counted(make_rig):
    rig = make_rig(["It is 12."])
    stranger = client_for(rig, "sk-not-a-rollout")
    with pytest.raises(openai.AuthenticationError) as info:
        stranger.chat.completions.create(model="m", messages=QUESTION)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    assert info.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()

    trace, client = opened(rig)
    assert (
        client.chat.completions.create(model="m", messages=QUESTION).choices[0].message.content == "It is 12."
    )
    assert rig.close(trace) == 0  # nothing was in flight
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="m", messages=QUESTION)
    assert info.value.body["code"] == "expired_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="m", prompt="late")

    assert len(trace.turns) == 1 and len(rig.fake.completion_prompts) == 1  # nothing served after the close
    counts = rig.counts()
    assert counts["harness/unauthorized_count"] == 4
    assert counts.get("harness/rejected_request_count", 0) == 0


def test_each_rollout_records_only_its_own_requests(make_rig):
    rig = make_rig(["one", "two"])
    (a, client_a), (b, client_b) = opened(rig), opened(rig)
    assert a.token != b.token
    client_a.chat.completions.create(model="m", messages=QUESTION)
    client_b.completions.create(model="m", prompt="x")
    assert (len(a.turns), len(b.turns)) == (1, 1)
    assert (a.conversation[-1]["content"], b.last_text) == ("one", "two")


# -- openai_api, pure --------------------------------------------------------------------------------------------
RUN = api.RunSampling(
    temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_completion_length=32
)


def test_reply_key_ignores_call_ids_and_argument_formatting():
    sent = answers.assistant_message(
        ParsedReply("Let me multiply.", [ToolCall("multiply", {"a": 3, "b": 4})])
    )
    fn = sent["tool_calls"][0]["function"]
    back = {
        "role": "assistant",
        "content": "  Let me multiply.\n",
        "tool_calls": [
            {
                "id": "call_other",
                "type": "function",
                "function": {"name": fn["name"], "arguments": '{ "b":4,\n "a" :3 }'},
            }
        ],
    }
    assert api.reply_key(back) == api.reply_key(sent)
    as_data = {**back, "tool_calls": [{"function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]}
    assert api.reply_key(as_data) == api.reply_key(sent)  # arguments as data, no id at all
    other_args = {**back, "tool_calls": [{"function": {"name": "multiply", "arguments": '{"a": 3, "b": 5}'}}]}
    other_text = {**back, "content": "I will multiply."}
    assert api.reply_key(other_args) != api.reply_key(sent)
    assert api.reply_key(other_text) != api.reply_key(sent)
    assert api.reply_key({"role": "assistant", "content": None}) == api.reply_key({"content": ""})


def test_assistant_message_leaves_malformed_calls_out():
    good = ToolCall("multiply", {"a": 3, "b": 4})
    bad = ToolCall("multiply", {}, error="malformed JSON")
    only_calls = answers.assistant_message(ParsedReply("", [good]))
    assert only_calls["content"] is None and len(only_calls["tool_calls"]) == 1
    assert only_calls["tool_calls"][0]["function"]["arguments"] == '{"a": 3, "b": 4}'
    malformed = answers.assistant_message(ParsedReply("", [bad]))
    assert malformed == {"role": "assistant", "content": ""}
    assert answers.finish_reason("stop", only_calls) == "tool_calls"
    assert answers.finish_reason("stop", malformed) == "stop"
    assert answers.finish_reason("length", only_calls) == "length"


def test_parse_chat_converts_messages_for_the_template():
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "3 times "}, {"type": "text", "text": "4?"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "12"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
        "parallel_tool_calls": True,
        "user": "someone",
        "an_unknown_extra": 1,
    }
    req = api.parse_chat(body, RUN)
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "3 times 4?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "content": "12", "tool_call_id": "c1"},
    ]
    assert req.raw_messages is body["messages"]
    assert (req.stream, req.include_usage, req.template_kwargs) == (True, True, {"enable_thinking": False})
    assert (req.max_tokens, req.explicit_max_tokens) == (32, False)
    with pytest.raises(api.Rejected) as info:
        api.parse_chat({"messages": [{"role": "narrator", "content": "x"}]}, RUN)
    assert info.value.param == "messages[0].role"
    with pytest.raises(api.Rejected) as info:
        api.parse_chat({"messages": []}, RUN)
    assert info.value.param == "messages"


def test_top_k_must_match_the_run():
    assert api.parse_chat({"messages": QUESTION, "top_k": -1}, RUN).max_tokens == 32  # -1 and 0 both mean off
    with pytest.raises(api.Rejected) as info:
        api.parse_chat({"messages": QUESTION, "top_k": 20}, RUN)
    assert info.value.param == "top_k"
    run_k = api.RunSampling(1.0, 1.0, 20, 0.0, 1.0, 32)
    assert api.parse_chat({"messages": QUESTION, "top_k": 20}, run_k).max_tokens == 32
    with pytest.raises(api.Rejected):
        api.parse_chat({"messages": QUESTION, "top_k": 0}, run_k)


def test_sse_ends_with_done():
    events = [{"a": 1}, {"b": "é"}]
    assert answers.sse(events).decode("utf-8") == 'data: {"a": 1}\n\ndata: {"b": "é"}\n\ndata: [DONE]\n\n'
