"""Tool calls and tools of agent rollouts: Hermes parsing, schemas, ``load_tools`` checks, ``run_tool_calls``.

Plain data and a thread pool: no tokenizer, no server. The tools live in ``tests/helpers/agent_tools.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncgrpo_cli import registry
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.agent.tool_calls import HermesToolCallParser, ToolCall, tool_call_parser
from asyncgrpo_cli.rollout.agent.tools import (
    ToolResult,
    check_unique,
    load_tools,
    run_tool_calls,
    tool_from_callable,
)
from tests.helpers import agent_tools

H = "tests.helpers.agent_tools:"


def parse(text: str):
    return HermesToolCallParser().parse(text)


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# -- parsing ---------------------------------------------------------------------------------------------------
class TestHermesParsing:
    def test_well_formed_call(self):
        reply = parse(block('{"name": "multiply", "arguments": {"a": 3, "b": 4}}'))
        assert reply.content == ""
        assert reply.calls == [ToolCall("multiply", {"a": 3, "b": 4})]
        assert reply.calls[0].message_entry() == {
            "type": "function",
            "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}},
        }

    def test_several_blocks_in_order_and_text_outside_kept(self):
        text = (
            "Let me compute.\n"
            + block('{"name": "multiply", "arguments": {"a": 1, "b": 2}}')
            + "\nthen\n"
            + block('{"name": "async_add", "arguments": {"a": 5, "b": 6}}')
            + "\n"
        )
        reply = parse(text)
        assert [c.name for c in reply.calls] == ["multiply", "async_add"]
        assert reply.calls[1].arguments == {"a": 5, "b": 6}
        assert reply.content == "Let me compute.\n\nthen"
        assert all(c.error is None for c in reply.calls)

    def test_a_list_in_one_block_is_several_calls(self):
        body = json.dumps([{"name": "b", "arguments": {"x": 1}}, {"name": "a"}])
        reply = parse(block(body))
        assert reply.calls == [ToolCall("b", {"x": 1}), ToolCall("a", {})]

    def test_arguments_as_a_json_string(self):
        reply = parse(block(json.dumps({"name": "multiply", "arguments": '{"a": 2, "b": 3}'})))
        assert reply.calls == [ToolCall("multiply", {"a": 2, "b": 3})]

    def test_malformed_json_keeps_the_readable_name(self):
        (call,) = parse(block('{"name": "multiply", "arguments": {"a": 2,, }}')).calls
        assert call.name == "multiply" and call.arguments == {}
        assert "not valid JSON" in call.error and "line" in call.error
        (call,) = parse(block("not json at all")).calls
        assert call.name == "" and "not valid JSON" in call.error

    @pytest.mark.parametrize(
        ("body", "name", "needle"),
        [
            ('{"arguments": {"a": 1}}', "", '"name"'),
            ('{"name": 7, "arguments": {}}', "", '"name"'),
            ('{"name": "multiply", "arguments": [1, 2]}', "multiply", "must be a JSON object"),
            ('{"name": "multiply", "arguments": "[1, 2]"}', "multiply", "must be a JSON object"),
            ('{"name": "multiply", "arguments": "{oops"}', "multiply", "not valid JSON"),
            ('"multiply"', "", "must be a JSON object"),
            ("[]", "", "empty list"),
        ],
    )
    def test_malformed_calls(self, body, name, needle):
        (call,) = parse(block(body)).calls
        assert (call.name, call.arguments) == (name, {})
        assert needle in call.error

    def test_unterminated_final_block_is_one_malformed_call(self):
        text = (
            "Sure.\n"
            + block('{"name": "multiply", "arguments": {}}')
            + '\n<tool_call>\n{"name": "async_add", "argu'
        )
        reply = parse(text)
        assert reply.content == "Sure."
        assert reply.calls[0] == ToolCall("multiply", {})
        assert reply.calls[1].name == "async_add" and reply.calls[1].arguments == {}
        assert "never closed" in reply.calls[1].error

    def test_no_call_and_stray_closing_tag_are_content(self):
        assert parse("  The answer is 12.  ") == parse("The answer is 12.")
        reply = parse("done </tool_call>")
        assert reply.calls == [] and reply.content == "done </tool_call>"

    def test_long_reply_is_parsed_in_linear_time(self):
        # Inputs that make a backtracking regex quadratic: many opening tags, a long unclosed "name" string.
        start = time.perf_counter()
        parse("<tool_call>" * 20_000)
        parse(block('{"name": "' + "\\a" * 200_000))
        parse(("x" * 1000 + block('{"name": "f"}')) * 300)
        assert time.perf_counter() - start < 1.0

    def test_parser_by_name(self):
        assert tool_call_parser("hermes").name == "hermes"
        with pytest.raises(UserError, match=r"rollout\.tool_call_format.*'qwen_xml'.*choices: hermes"):
            tool_call_parser("qwen_xml")


# -- schemas and load_tools ------------------------------------------------------------------------------------
@pytest.fixture
def tool_kind(monkeypatch):
    """The registry kind "tool" (registry.py gains it with the agent feature; provided here until it does)."""
    if "tool" not in registry.KINDS:
        monkeypatch.setattr(registry, "KINDS", (*registry.KINDS, "tool"))
        monkeypatch.setitem(registry.CONFIG_KEYS, "tool", "rollout.tools")
        monkeypatch.setitem(registry._REGISTRY, "tool", {})


class TestSchemas:
    def test_schema_from_google_docstring(self):
        tool = tool_from_callable(agent_tools.multiply, "rollout.tools[0]")
        assert (tool.name, tool.is_async, tool.key) == ("multiply", False, "rollout.tools[0]")
        fn = tool.schema["function"]
        assert tool.schema["type"] == "function" and fn["name"] == "multiply"
        assert fn["description"] == "Multiply two integers."
        assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first factor."}
        assert fn["parameters"]["required"] == ["a", "b"]
        assert tool_from_callable(agent_tools.async_add, "k").is_async

    def test_schema_from_bound_method(self):
        env = agent_tools.GameEnv()
        tool = tool_from_callable(env.move, "environment game (GameEnv.move)")
        params = tool.schema["function"]["parameters"]
        assert tool.name == "move" and list(params["properties"]) == ["action"]  # no self
        assert params["properties"]["action"]["enum"] == ["left", "right"]
        assert tool.fn("right") == "1" and env.position == 1

    @pytest.mark.parametrize("fn", [agent_tools.undocumented, agent_tools.unhinted])
    def test_schema_errors_name_the_key_and_the_fix(self, fn):
        with pytest.raises(UserError, match=r"rollout\.tools\[3\]: cannot build the schema.*'Args:'"):
            tool_from_callable(fn, "rollout.tools[3]")


class TestLoadTools:
    def test_import_paths(self, tool_kind):
        tools = load_tools([H + "multiply", H + "async_add"])
        assert [(t.name, t.key, t.is_async) for t in tools] == [
            ("multiply", "rollout.tools[0]", False),
            ("async_add", "rollout.tools[1]", True),
        ]

    def test_registered_name_goes_through_the_registry(self, tool_kind, monkeypatch):
        spec = registry.PluginSpec("tool", "times", H + "multiply", "multiply two integers")
        monkeypatch.setitem(registry._REGISTRY["tool"], "times", spec)
        (tool,) = load_tools(["times"])
        assert tool.name == "multiply" and tool.fn is agent_tools.multiply

    @pytest.mark.parametrize(
        ("attr", "needle"),
        [
            (
                "lambda_tool",
                "a lambda cannot be pickled into the rollout process: define it with def at module",
            ),
            ("closure_tool", "_make_closure.<locals>.add_offset is defined inside another function"),
            ("nested_tool", "_make_nested.<locals>.nested is defined inside another function"),
            ("CALL_LOG", "is a list, not a function"),
            ("undocumented", "cannot build the schema of tool 'undocumented'"),
        ],
    )
    def test_refused(self, tool_kind, attr, needle):
        with pytest.raises(UserError) as err:
            load_tools([H + "multiply", H + attr])
        assert str(err.value).startswith("rollout.tools[1]") and needle in str(err.value)

    def test_unknown_module_and_attribute(self, tool_kind):
        with pytest.raises(
            UserError, match=r"^rollout\.tools\[0\] \('no_such_mod:f'\): cannot import module"
        ):
            load_tools(["no_such_mod:f"])
        with pytest.raises(UserError, match=r"^rollout\.tools\[0\] .*has no attribute 'nope'"):
            load_tools([H + "nope"])

    def test_duplicate_names_name_both_keys(self, tool_kind):
        with pytest.raises(
            UserError, match=r"rollout\.tools\[0\] and rollout\.tools\[2\] both .* 'multiply'"
        ):
            load_tools([H + "multiply", H + "async_add", H + "multiply"])
        env_tool = tool_from_callable(agent_tools.GameEnv().move, "environment game (GameEnv.move)")
        other = tool_from_callable(agent_tools.GameEnv().move, "rollout.tools[1]")
        with pytest.raises(UserError, match=r"rollout\.tools\[1\] and environment game \(GameEnv\.move\)"):
            check_unique([other, env_tool])


# -- run_tool_calls --------------------------------------------------------------------------------------------
def by_name(*fns) -> dict:
    return {fn.__name__: tool_from_callable(fn, f"rollout.tools[{i}]") for i, fn in enumerate(fns)}


TOOLS = by_name(
    agent_tools.multiply,
    agent_tools.async_add,
    agent_tools.explode,
    agent_tools.slow_echo,
    agent_tools.async_sleep,
    agent_tools.record,
    agent_tools.thread_name,
    agent_tools.summarize,
    agent_tools.nothing,
)


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="agent-tools") as executor:
        yield executor


def run(calls, executor, metrics=None, timeout_s=None) -> list[ToolResult]:
    return asyncio.run(run_tool_calls(calls, TOOLS, executor, metrics, timeout_s))


class TestRunToolCalls:
    def test_sync_and_async_tools_and_result_text(self, pool):
        calls = [
            ToolCall("multiply", {"a": 6, "b": 7}),
            ToolCall("async_add", {"a": 2, "b": 3}),
            ToolCall("summarize", {"values": [1.5, 2.5]}),
            ToolCall("nothing", {}),
        ]
        results = run(calls, pool)
        assert [r.content for r in results] == ["42", "5", '{"n": 2, "sum": 4.0, "label": "résumé"}', "null"]
        assert not any(r.failed or r.unknown for r in results)
        assert results[0].message() == {"role": "tool", "name": "multiply", "content": "42"}

    def test_calls_run_sequentially_in_order(self, pool):
        agent_tools.CALL_LOG.clear()
        calls = [
            ToolCall("record", {"tag": "first", "seconds": 0.05}),
            ToolCall("record", {"tag": "second", "seconds": 0}),
        ]
        assert [r.content for r in run(calls, pool)] == ["first", "second"]
        assert agent_tools.CALL_LOG == ["first", "second"]  # the fast second call waited for the slow first

    def test_sync_tools_run_on_the_given_executor(self, pool):
        (result,) = run([ToolCall("thread_name", {})], pool)
        assert result.content.startswith("agent-tools")
        assert threading.current_thread().name != result.content

    def test_a_slow_tool_delays_only_its_own_rollout(self, pool):
        slow = [ToolCall("slow_echo", {"text": "done", "seconds": 0.3})]
        fast = [ToolCall("multiply", {"a": 2, "b": 2}), ToolCall("async_add", {"a": 1, "b": 1})]

        async def rollout(calls):
            results = await run_tool_calls(calls, TOOLS, pool, None, None)
            return results, time.perf_counter()

        async def three_rollouts():
            start = time.perf_counter()
            out = await asyncio.gather(rollout(slow), rollout(slow), rollout(slow), rollout(fast))
            return start, out

        start, out = asyncio.run(three_rollouts())
        ends = [end - start for _, end in out]
        assert [r.content for r in out[0][0]] == ["done"] and [r.content for r in out[3][0]] == ["4", "2"]
        assert max(ends) < 0.6, ends  # ~0.3 s, not the 0.9 s of the three slow calls one after another
        assert ends[3] < 0.2, ends  # the fast rollout did not wait for the slow ones

    def test_failures_are_messages_for_the_model(self, pool):
        calls = [
            ToolCall("explode", {"reason": "boom"}),
            ToolCall("multiply", {"a": 1}),
            ToolCall("async_add", {"a": 1, "b": 2, "c": 3}),
            ToolCall("search_web", {"q": "x"}),
            ToolCall("", {}, error="the tool call is not valid JSON: Expecting value at line 1 column 1"),
        ]
        results = run(calls, pool)
        assert all(r.failed for r in results)
        assert results[0].content == "error: RuntimeError: boom"
        assert results[1].content.startswith("error: TypeError: ") and "'b'" in results[1].content
        assert results[2].content.startswith("error: TypeError: ") and "'c'" in results[2].content
        assert [r.unknown for r in results] == [False, False, False, True, False]
        assert (
            "no tool named 'search_web'" in results[3].content
            and "available tools: async_add, async_sleep, explode," in results[3].content
        )
        assert results[4].content == "error: malformed tool call: " + calls[4].error

    def test_timeouts(self, pool):
        calls = [
            ToolCall("slow_echo", {"text": "late", "seconds": 0.3}),
            ToolCall("async_sleep", {"seconds": 5}),
            ToolCall("multiply", {"a": 3, "b": 3}),
        ]
        start = time.perf_counter()
        results = run(calls, pool, timeout_s=0.05)
        assert time.perf_counter() - start < 0.25  # the rollout did not wait for the stuck thread
        assert [r.failed for r in results] == [True, True, False]
        assert results[0].content == "error: the tool 'slow_echo' did not return within 0.05 s"
        assert "'async_sleep' did not return" in results[1].content and results[2].content == "9"
        assert 0.04 < results[0].latency_s < 0.2

    def test_metrics(self, pool):
        metrics = MetricWindow()
        run([ToolCall("multiply", {"a": 1, "b": 2}), ToolCall("explode", {"reason": "x"})], pool, metrics)
        run(
            [ToolCall("multiply", {"a": 1}), ToolCall("nope", {}), ToolCall("multiply", {}, error="bad")],
            pool,
            metrics,
        )
        run([], pool, metrics)
        out = metrics.reduce()
        assert out["tools/multiply/call_count"] == 3 and out["tools/multiply/failure_count"] == 2
        assert out["tools/explode/call_count"] == 1 and out["tools/explode/failure_count"] == 1
        assert out["tools/unknown_name_count"] == 1
        assert out["tools/parallel_calls_mean"] == 2.5  # turns of 2 and 3 calls; the empty turn is not one
        items = metrics.to_payload()["items"]
        assert len(items["tools/latency_s"]) == 3  # executed calls only: not the unknown, not the malformed
        assert len(items["tools/multiply/latency_s"]) == 2
        assert 0 <= out["tools/latency_s"] < 0.5
        assert not any("nope" in name for name in out)  # made-up names never become metric names
