"""Chat templates for multi-turn tool rollouts: swap in a shipped training template, or check the model's own.

A tool loop renders the whole conversation each turn and keeps one training sample only while every turn's prompt
starts with the previous prompt + the sampled tokens + eos (reference m.7); anything else forks the sample. So the
template must be *prefix-preserving*: ``render(C, gen) + RAW + eos`` is a prefix of
``render(C + [assistant RAW] + tool results, gen)``, with the same ``tools`` and ``model.chat_template_kwargs``.

Rules (``choose_chat_template``, called once at startup when tools or environments are configured):

1. A known family gets its shipped training template, which renders first turns exactly like the original (checked
   on probe conversations with the user's kwargs before the swap; a template that only looks like the family is
   left alone):
   - ``chatml``: plain ChatML without tool support (the tiny tokenizer's, SmolLM2's, which also inserts a default
     system message: kept). Adds Hermes-style ``# Tools`` in the system message, renders assistant content
     verbatim and ``tool`` messages under the ``tool`` role.
   - ``qwen3``: the official Qwen3 (hybrid thinking) template, see ``QWEN3_TRAINING_TEMPLATE``.
2. Every template, shipped or not, is run through ``check_prefix_preserving``: text first, then token ids (BPE can
   merge across a boundary that is a text prefix). A problem raises ``UserError`` when
   ``rollout.require_prefix_preserving_template`` is true; otherwise it is returned for the caller to warn.

Rendering only: no torch, no server; runs in the rollout process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from asyncgrpo_cli.errors import UserError

_TOOLS_BLOCK = (
    '{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided '
    'with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}\n'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
)
"""Hermes tool list for the system message (Qwen's wording, which Hermes-trained models know); ends the block."""

_STRUCTURED_TOOL_CALLS = """\
{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}
  {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
  {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
  {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
  {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
  {{- '}\\n</tool_call>' }}
{%- endfor %}{%- endif %}
"""
"""``tool_calls`` given as data (few-shot prompts) rendered as Hermes blocks after the content, as Qwen does; the
tool loop itself never sets them (the sampled text already holds the calls)."""

_CHATML_BODY = (
    """\
{%- if messages and messages[0].role == 'system' %}
  {%- set system_message = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}
  {%- set system_message = default_system_message %}{%- set rest = messages %}
{%- endif %}
{%- if tools %}
  {{- '<|im_start|>system\\n' }}{%- if system_message %}{{- system_message + '\\n\\n' }}{%- endif %}
"""
    + _TOOLS_BLOCK
    + """\
{%- elif system_message is not none %}
  {{- '<|im_start|>system\\n' + system_message + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in rest %}
  {%- set content = message.content if message.content is string else '' %}
  {{- '<|im_start|>' + message.role + '\\n' + content }}
  {%- if message.role == 'assistant' %}
"""
    + _STRUCTURED_TOOL_CALLS
    + """\
  {%- endif %}
  {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
)


def chatml_training_template(default_system_message: str | None) -> str:
    """The ChatML training template; ``default_system_message`` is rendered when the first message is not a system
    message (``None``: no system message then, unless tools are given)."""
    literal = (
        "none" if default_system_message is None else json.dumps(default_system_message, ensure_ascii=False)
    )
    return "{%- set default_system_message = " + literal + " %}\n" + _CHATML_BODY


QWEN3_TRAINING_TEMPLATE = (
    """\
{%- if tools %}
  {{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
"""
    + _TOOLS_BLOCK
    + """\
{%- elif messages[0].role == 'system' %}
  {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
  {%- set index = (messages|length - 1) - loop.index0 %}
  {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
    {%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
  {%- endif %}
{%- endfor %}
{%- set no_think = enable_thinking is defined and enable_thinking is false %}
{%- for message in messages %}
  {%- set content = message.content if message.content is string else '' %}
  {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
  {%- elif message.role == "assistant" %}
    {%- set reasoning = message.reasoning_content if message.reasoning_content is string else none %}
    {%- if loop.index0 <= ns.last_query_index %}
      {%- if reasoning is none and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
      {%- endif %}
      {{- '<|im_start|>assistant\\n' + content }}
    {%- elif reasoning %}
      {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
    {%- else %}
      {{- '<|im_start|>assistant\\n' }}{%- if no_think %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{- content }}
    {%- endif %}
"""
    + _STRUCTURED_TOOL_CALLS
    + """\
    {{- '<|im_end|>\\n' }}
  {%- elif message.role == "tool" %}
    {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
    {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\\n' }}{%- if no_think %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
)
"""Renders the text of Qwen3's official template except for assistant turns after the last user query (the tool
loop's own turns). Official, as measured by the tests: with ``enable_thinking=false`` every tool step forks, since
the generation prompt's empty ``<think>\\n\\n</think>\\n\\n`` is not rendered before the turn once it is
history; with thinking on (or unset), a reply's empty think block is dropped and a reasoning block is re-serialised
with normalised whitespace. Here such a turn is the content exactly as sampled, after the same empty think block
under ``enable_thinking=false``. Unchanged: the tools block, system/user/tool messages, the generation prompt,
assistant turns up to the last user query (reasoning dropped, as official) and ``reasoning_content`` given as data.
So a first-turn prompt renders identically unless it already holds assistant turns after its last user message
(an in-context tool exchange), which render the loop's way."""


@dataclass
class TemplateChoice:
    template: str | None
    """The chat template to use (None: keep the tokenizer's)."""
    family: str | None
    """``chatml``, ``qwen3``, ... when a shipped training template was swapped in."""
    problem: str | None
    """None when prefix-preserving, else a readable description of the first difference."""


_ARGS = {k: {"type": "integer", "description": f"The {k} operand."} for k in ("a", "b")}
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.capitalize()} two integers.",
            "parameters": {"type": "object", "properties": _ARGS, "required": ["a", "b"]},
        },
    }
    for name in ("multiply", "add")
]
_SYSTEM = {"role": "system", "content": "You are a careful assistant."}
_USER = {"role": "user", "content": "What is 6 times 7, plus 5?"}


def _call(name: str, a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def _render(tokenizer, template: str, messages: list, kwargs: dict, tools=_TOOLS, gen: bool = True) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, add_generation_prompt=gen, tokenize=False, **kwargs
    )


def _probes(template: str) -> list[list[dict]]:
    """Tool-loop conversations: a reply with one call, its result, a reply with two calls, their results; with and
    without a system message. With thinking markup too when the template handles ``</think>``: a reasoning block,
    and an empty one (what a thinking model writes when it skips thinking)."""
    prefixes = [""]
    if "</think>" in template:
        prefixes += ["<think>\nThe user wants a sum.\n</think>\n\n", "<think>\n\n</think>\n\n"]
    one = "I will multiply first.\n" + _call("multiply", 6, 7)
    two = _call("add", 42, 5) + "\n" + _call("multiply", 1, 47)
    results = [("multiply", "42")], [("add", "47"), ("multiply", "47")]
    out = []
    for system in ([], [_SYSTEM]):
        for prefix in prefixes:
            conversation = [*system, _USER]
            for reply, tools in zip((one, two), results):
                conversation.append({"role": "assistant", "content": prefix + reply})
                conversation += [{"role": "tool", "name": name, "content": text} for name, text in tools]
            out.append(conversation)
    return out


def _excerpt(text: str, pos: int) -> str:
    return repr(text[max(0, pos - 20) : pos + 20])


def _which(tokenizer, template: str, history: list[dict], prompt: str, pos: int, kwargs: dict) -> str:
    """The part of ``prompt + reply + eos`` at character ``pos``: a message of ``history``, the generation prompt,
    the reply or the eos."""
    if pos >= len(prompt):
        return "the sampled assistant reply (or the eos after it)"
    bare = _render(tokenizer, template, history, kwargs, gen=False)
    if prompt.startswith(bare) and pos >= len(bare):
        gen = prompt[len(bare) :]
        return f"the generation prompt {gen!r}, which the template does not render before that turn once it is history"
    owner, start = 0, 0
    for i, message in enumerate(history):
        found = prompt.find(str(message.get("content") or ""), start)
        if found < 0 or found > pos:
            break
        owner, start = i, found
    return f"message {owner} ({history[owner]['role']})"


def check_prefix_preserving(tokenizer, template: str, chat_template_kwargs: dict) -> str | None:
    """None when every probe turn's prompt + reply + eos is a prefix of the next turn's prompt, in text and in token
    ids; else the first difference: turn, message, character or token position, and the texts around it."""
    kwargs = dict(chat_template_kwargs)
    for conversation in _probes(template):
        turns = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
        for n, i in enumerate(turns):
            upto = turns[n + 1] if n + 1 < len(turns) else len(conversation)
            roles = ", ".join(m["role"] for m in conversation[:upto])
            reply = conversation[i]["content"]
            where = f"probe conversation [{roles}], assistant turn {n + 1} (reply {reply[:24]!r}...)"
            try:  # a template may reject roles or arguments (raise_exception, TypeError, ...)
                problem = _check_turn(tokenizer, template, conversation[:i], conversation[i:upto], kwargs)
            except Exception as e:
                problem = f"rendering failed: {type(e).__name__}: {e}"
            if problem:
                return f"{where}: {problem}"
    return None


def _check_turn(tokenizer, template: str, history: list[dict], added: list[dict], kwargs: dict) -> str | None:
    """``added`` is the sampled reply (``added[0]``) and the tool results that follow it."""
    reply, eos = added[0]["content"], tokenizer.eos_token or ""
    prompt = _render(tokenizer, template, history, kwargs)
    expected = prompt + reply + eos
    rendered = _render(tokenizer, template, history + added, kwargs)
    if not rendered.startswith(expected):
        pos = next((k for k, (a, b) in enumerate(zip(expected, rendered)) if a != b), len(rendered))
        part = _which(tokenizer, template, history, prompt, pos, kwargs)
        return (
            f"the next prompt does not start with prompt + reply + eos; first difference at character {pos}, in "
            f"{part}: expected {_excerpt(expected, pos)}, the template rendered {_excerpt(rendered, pos)}"
        )
    encode = tokenizer.encode
    ids = [*encode(prompt, add_special_tokens=False), *encode(reply, add_special_tokens=False)]
    ids += encode(eos, add_special_tokens=False)
    got = encode(rendered, add_special_tokens=False)[: len(ids)]
    if got == ids:
        return None
    k = next((k for k, (a, b) in enumerate(zip(ids, got)) if a != b), len(got))
    pieces = tokenizer.convert_ids_to_tokens
    return (
        f"the text is a prefix but the token ids are not (BPE merges across a boundary); first difference at "
        f"token {k}: prompt + reply + eos has {pieces(ids[k : k + 3])}, the next prompt tokenizes as "
        f"{pieces(got[k : k + 3])}"
    )


_HISTORY = [
    _USER,
    {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n47."},
    {"role": "user", "content": "2+2?"},
]
_FIRST_TURNS = [[_USER], [_SYSTEM, _USER], _HISTORY, [_SYSTEM, *_HISTORY]]
"""Conversations a dataset prompt can be (first turns), for checking that a swap renders them unchanged."""


def _renders_alike(tokenizer, original: str, training: str, kwargs: dict, tools_too: bool) -> bool:
    for tools in [None, _TOOLS] if tools_too else [None]:
        for conversation in _FIRST_TURNS:
            for gen in (True, False):
                a = _render(tokenizer, original, conversation, kwargs, tools=tools, gen=gen)
                if a != _render(tokenizer, training, conversation, kwargs, tools=tools, gen=gen):
                    return False
    return True


def _as_chatml(tokenizer, original: str, kwargs: dict) -> str | None:
    """The ChatML training template when ``original`` is plain ChatML that ignores tools, with its default system
    message (read off a one-message render), else None."""
    text = _render(tokenizer, original, [_USER], kwargs, tools=None)
    if _render(tokenizer, original, [_USER], kwargs) != text:
        return None  # it renders tools: not the plain family
    tail = f"<|im_start|>user\n{_USER['content']}<|im_end|>\n<|im_start|>assistant\n"
    if not text.endswith(tail):
        return None
    head, system = text[: -len(tail)], None
    if head:
        if not (head.startswith("<|im_start|>system\n") and head.endswith("<|im_end|>\n")):
            return None
        system = head[len("<|im_start|>system\n") : -len("<|im_end|>\n")]
    training = chatml_training_template(system)
    return training if _renders_alike(tokenizer, original, training, kwargs, tools_too=False) else None


_QWEN3_MARKERS = (
    "last_query_index",
    "multi_step_tool",
    "reasoning_content",
    "enable_thinking",
    "<tool_response>",
)


def _as_qwen3(tokenizer, original: str, kwargs: dict) -> str | None:
    """The Qwen3 training template when ``original`` carries the official Qwen3 markers and renders first turns as
    the training template does, else None (e.g. Qwen3-2507 Thinking, whose generation prompt opens ``<think>``)."""
    if not all(m in original for m in _QWEN3_MARKERS) or "<function=" in original:
        return None
    if not _renders_alike(tokenizer, original, QWEN3_TRAINING_TEMPLATE, kwargs, tools_too=True):
        return None
    return QWEN3_TRAINING_TEMPLATE


_FAMILIES = (("qwen3", _as_qwen3), ("chatml", _as_chatml))


def choose_chat_template(
    tokenizer, chat_template_kwargs: dict, require_prefix_preserving: bool
) -> TemplateChoice:
    """The template for tool rollouts: a shipped training template for a known family, else the tokenizer's own,
    with ``problem`` set when it is not prefix-preserving (raised as ``UserError`` when required)."""
    original = tokenizer.chat_template
    if isinstance(
        original, dict
    ):  # named templates: apply_chat_template(tools=...) takes tool_use, else default
        original = original.get("tool_use") or original.get("default")
    if not isinstance(original, str) or not original:
        raise UserError(
            "model.name_or_path: the tokenizer has no chat template for tool rollouts (a string, or a 'tool_use' or "
            "'default' named template); use a chat model whose tokenizer sets one."
        )
    kwargs = dict(chat_template_kwargs)
    choice = None
    for family, build in _FAMILIES:
        try:
            training = build(tokenizer, original, kwargs)
        except Exception:  # the original cannot even render the probes: not this family
            training = None
        if training is not None:
            choice = TemplateChoice(training, family, check_prefix_preserving(tokenizer, training, kwargs))
            break
    if choice is None:
        choice = TemplateChoice(None, None, check_prefix_preserving(tokenizer, original, kwargs))
    if choice.problem and require_prefix_preserving:
        raise UserError(
            "rollout.require_prefix_preserving_template is true but the chat template is not prefix-preserving "
            f"(with model.chat_template_kwargs={kwargs}): {choice.problem}. Each turn would fork the sample "
            "(costing forward tokens). Use a model family with a shipped training template (ChatML, Qwen3), pass "
            "a prefix-preserving template (save the tokenizer with one), or set "
            "rollout.require_prefix_preserving_template=false to train with forks."
        )
    return choice
