"""Chat templates for tool rollouts: the shipped training templates (ChatML, Qwen3) are swapped in, render first turns
like the originals and are prefix-preserving; other templates get a readable problem (text or token level), raised
when ``rollout.require_prefix_preserving_template`` is set. Text-level renders with the tiny tokenizer; SmolLM2's
cached tokenizer where present."""

from __future__ import annotations

import pytest

from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.model.tiny import CHATML_TEMPLATE, build_tiny_tokenizer
from asyncgrpo_cli.rollout.agent import templates as T
from tests.helpers.qwen3_template import QWEN3_CHAT_TEMPLATE

EOS = "<|im_end|>"
TOOLS = T._TOOLS
USER = {"role": "user", "content": "What is 6 times 7?"}
SYSTEM = {"role": "system", "content": "Be brief."}
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def render(tok, template, messages, tools=TOOLS, gen=True, **kwargs):
    return tok.apply_chat_template(
        messages, tools=tools, chat_template=template, add_generation_prompt=gen, tokenize=False, **kwargs
    )


def with_template(tok, template):
    tok.chat_template = template
    return tok


def loop_step_is_prefix(tok, template, history, reply, results, **kwargs) -> bool:
    """One tool-loop step: the next prompt starts with prompt + reply + eos."""
    prompt = render(tok, template, history, **kwargs)
    following = [{"role": "assistant", "content": reply}, *results]
    return render(tok, template, history + following, **kwargs).startswith(prompt + reply + EOS)


# ---------------------------------------------------------------------------------------------- ChatML family


def test_tiny_chatml_template_is_swapped_and_prefix_preserving(tiny):
    choice = T.choose_chat_template(with_template(tiny, CHATML_TEMPLATE), {}, require_prefix_preserving=True)
    assert (choice.family, choice.problem) == ("chatml", None)
    assert T.check_prefix_preserving(tiny, choice.template, {}) is None
    # Without tools it renders as the original; with tools, a system message holds them (no default system here).
    for messages in ([USER], [SYSTEM, USER], [USER, {"role": "assistant", "content": "42"}, USER]):
        assert render(tiny, choice.template, messages, tools=None) == render(
            tiny, CHATML_TEMPLATE, messages, tools=None
        )
    text = render(tiny, choice.template, [USER, {"role": "assistant", "content": CALL}, tool("42")])
    assert text.startswith("<|im_start|>system\n# Tools\n\n") and '"name": "multiply"' in text
    assert "<tools>\n{" in text and "}\n</tools>" in text and '<tool_call>\n{"name": <function-name>' in text
    assert (
        f"<|im_start|>assistant\n{CALL}<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
        in text
    )


def tool(content, name="multiply"):
    return {"role": "tool", "name": name, "content": content}


def test_smollm2_template_ignores_tools_and_the_swap_keeps_its_default_system(smollm2):
    official = smollm2.chat_template
    assert render(smollm2, official, [USER]) == render(smollm2, official, [USER], tools=None)  # tools dropped
    assert "multiply" not in render(smollm2, official, [USER])
    choice = T.choose_chat_template(smollm2, {}, require_prefix_preserving=True)
    assert (choice.family, choice.problem) == ("chatml", None)
    default = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    for messages in ([USER], [SYSTEM, USER], [USER, {"role": "assistant", "content": "42"}, USER]):
        assert render(smollm2, choice.template, messages, tools=None) == render(
            smollm2, official, messages, tools=None
        )
    assert render(smollm2, choice.template, [USER]).startswith(default + "\n\n# Tools\n\n")
    assert render(smollm2, choice.template, [SYSTEM, USER]).startswith(
        "<|im_start|>system\nBe brief.\n\n# Tools"
    )
    assert loop_step_is_prefix(smollm2, choice.template, [USER], "Let me call it.\n" + CALL, [tool("42")])


def test_default_system_message_with_quotes_and_unicode_round_trips(tiny):
    default = 'Tu es "Smol", né à Paris.\nBe kind.'
    original = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\n" + default.replace("\n", "\\n") + "<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    choice = T.choose_chat_template(with_template(tiny, original), {}, require_prefix_preserving=True)
    assert choice.family == "chatml"
    assert render(tiny, choice.template, [USER], tools=None) == render(tiny, original, [USER], tools=None)
    assert render(tiny, choice.template, [USER]).startswith(f"<|im_start|>system\n{default}\n\n# Tools")


def test_chatml_renders_tool_calls_given_as_data_in_hermes_format(tiny):
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
    messages = [USER, {"role": "assistant", "content": "Calling.", "tool_calls": [call, call]}, tool("42")]
    text = render(tiny, T.chatml_training_template(None), messages)
    block = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
    assert f"<|im_start|>assistant\nCalling.\n{block}\n{block}<|im_end|>\n" in text


def test_named_templates_use_tool_use_then_default(tiny):
    tiny.chat_template = {"default": CHATML_TEMPLATE}
    try:
        assert T.choose_chat_template(tiny, {}, require_prefix_preserving=True).family == "chatml"
    finally:
        tiny.chat_template = CHATML_TEMPLATE


# ---------------------------------------------------------------------------------------------- Qwen3 family

KWARGS = [{}, {"enable_thinking": True}, {"enable_thinking": False}]
FIRST_TURNS = [
    [USER],
    [SYSTEM, USER],
    [SYSTEM, USER, {"role": "assistant", "content": "<think>\nSimple.\n</think>\n\n42."}, {"role": "user", "content": "And 2+2?"}],
    [USER, {"role": "assistant", "content": "\nNo think block here."}, {"role": "user", "content": "Again?"}],
    [USER, {"role": "assistant", "content": "42", "reasoning_content": "6*7"}, SYSTEM, {"role": "user", "content": "x"}],
]  # fmt: skip


@pytest.mark.parametrize("kwargs", KWARGS, ids=["unset", "thinking", "no_thinking"])
def test_qwen3_is_detected_and_first_turns_render_identically(tiny, kwargs):
    choice = T.choose_chat_template(
        with_template(tiny, QWEN3_CHAT_TEMPLATE), kwargs, require_prefix_preserving=True
    )
    assert (choice.family, choice.problem) == ("qwen3", None)
    assert choice.template == T.QWEN3_TRAINING_TEMPLATE
    for messages in FIRST_TURNS:
        for tools in (None, TOOLS):
            official = render(tiny, QWEN3_CHAT_TEMPLATE, messages, tools=tools, **kwargs)
            assert render(tiny, choice.template, messages, tools=tools, **kwargs) == official
    if kwargs:  # both modes end the first prompt as the official generation prompt does
        empty = "<think>\n\n</think>\n\n" if not kwargs["enable_thinking"] else ""
        assert official.endswith("<|im_start|>assistant\n" + empty)


def test_qwen3_official_fails_the_check_where_measured(tiny):
    # enable_thinking=false: the empty think block of the generation prompt is gone once the turn is history.
    problem = T.check_prefix_preserving(tiny, QWEN3_CHAT_TEMPLATE, {"enable_thinking": False})
    assert "generation prompt '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'" in problem
    assert "assistant turn 1" in problem and "character" in problem
    # Thinking on (or unset): plain replies and canonical think blocks survive, an empty think block is dropped.
    for kwargs in ({}, {"enable_thinking": True}):
        problem = T.check_prefix_preserving(tiny, QWEN3_CHAT_TEMPLATE, kwargs)
        assert "reply '<think>\\n\\n</think>" in problem and "in the sampled assistant reply" in problem
        assert loop_step_is_prefix(
            tiny, QWEN3_CHAT_TEMPLATE, [USER], "<think>\nR\n</think>\n\n" + CALL, [tool("42")], **kwargs
        )
        # ... and think whitespace is normalised: a reasoning block ending in two newlines is rewritten.
        odd = "<think>\nR\n\n</think>\n\n" + CALL
        assert not loop_step_is_prefix(tiny, QWEN3_CHAT_TEMPLATE, [USER], odd, [tool("42")], **kwargs)
        assert loop_step_is_prefix(tiny, T.QWEN3_TRAINING_TEMPLATE, [USER], odd, [tool("42")], **kwargs)
    for kwargs in KWARGS:
        assert T.check_prefix_preserving(tiny, T.QWEN3_TRAINING_TEMPLATE, kwargs) is None


@pytest.mark.parametrize("kwargs", KWARGS, ids=["unset", "thinking", "no_thinking"])
def test_qwen3_training_template_keeps_every_turn_as_sampled(tiny, kwargs):
    template = T.QWEN3_TRAINING_TEMPLATE
    replies = ["<think>\nFirst multiply.\n</think>\n\n" + CALL, "<think>\n\n</think>\n\n" + CALL, CALL]
    history = [SYSTEM, USER]
    for reply in replies:
        assert loop_step_is_prefix(tiny, template, history, reply, [tool("42"), tool("7", "add")], **kwargs)
        history += [{"role": "assistant", "content": reply}, tool("42"), tool("7", "add")]
    text = render(tiny, template, history, **kwargs)
    gen = "<|im_start|>assistant\n" + (
        "<think>\n\n</think>\n\n" if kwargs == {"enable_thinking": False} else ""
    )
    assert all(
        f"{gen}{reply}<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n" in text for reply in replies
    )


def test_a_qwen3_lookalike_that_renders_differently_is_not_swapped(tiny):
    # Like Qwen3-2507 Thinking: the generation prompt opens the think block.
    opens_think = QWEN3_CHAT_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}"
    )
    assert opens_think != QWEN3_CHAT_TEMPLATE
    choice = T.choose_chat_template(with_template(tiny, opens_think), {}, require_prefix_preserving=False)
    assert (choice.template, choice.family) == (None, None)


# ---------------------------------------------------------------------------------------------- other templates

LAST_TWO = (
    "{% for message in messages[-2:] %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_non_preserving_template_names_the_difference(tiny):
    problem = T.check_prefix_preserving(tiny, LAST_TWO, {})
    assert (
        "assistant turn 1" in problem and "first difference at character 12, in message 0 (user)" in problem
    )
    assert "expected '<|im_start|>user\\nWhat is 6 times'" in problem
    assert "the template rendered '<|im_start|>assistant\\nI will mul'" in problem
    choice = T.choose_chat_template(with_template(tiny, LAST_TWO), {}, require_prefix_preserving=False)
    assert (choice.template, choice.family, choice.problem) == (None, None, problem)


def test_require_prefix_preserving_raises_naming_the_key(tiny):
    with pytest.raises(UserError) as err:
        T.choose_chat_template(with_template(tiny, LAST_TWO), {}, require_prefix_preserving=True)
    message = str(err.value)
    assert "rollout.require_prefix_preserving_template" in message and "message 0 (user)" in message
    assert "pass a prefix-preserving template" in message and "shipped training template" in message


def test_a_template_that_cannot_render_tool_messages_is_a_problem(tiny):
    strict = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    assert "rendering failed: TemplateError: no tool role" in T.check_prefix_preserving(tiny, strict, {})


def test_a_text_prefix_whose_tokens_merge_across_the_boundary_is_reported(smollm2):
    # The generation prompt ends with a space: alone it is the token 'Ġ', before the reply it merges into 'ĠI'.
    spaced = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' + message['content'] + "
        "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
    )
    problem = T.check_prefix_preserving(smollm2, spaced, {})
    assert "the text is a prefix but the token ids are not" in problem
    assert "['Ġ', 'I', 'Ġwill']" in problem and "['ĠI', 'Ġwill'" in problem
