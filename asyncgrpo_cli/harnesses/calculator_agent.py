"""A two-turn agent with a calculator tool, for ``rollout.harness.command=[python, -m,
asyncgrpo_cli.harnesses.calculator_agent]`` (or a copy of this file anywhere: it uses only the standard library).

What any harness does, in a few lines: read the dataset row (one JSON object) from standard input; talk to
``$OPENAI_BASE_URL`` with ``$OPENAI_API_KEY`` and model ``$ASYNCGRPO_MODEL`` through ``/chat/completions``; print
``{"reward": ...}`` as the last line of standard output (or nothing, and let the run's reward functions score).

Here: turn 1 sends the row's ``prompt`` messages with the calculator tool; when the reply calls it, the agent
evaluates each expression, sends the results as ``tool`` messages and takes turn 2's reply as the answer. With a
``solution`` column the reward is 1.0 when the answer's last ``\\boxed{}`` equals it, else 0.0.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
import sys
import urllib.error
import urllib.request

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return its value.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": 'An arithmetic expression using numbers, + - * / and parentheses, e.g. "37 * 24 + 5".',
                }
            },
            "required": ["expression"],
        },
        "return": {"type": "string", "description": "The value of the expression."},
    },
}
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate(expression: str) -> str:
    """+ - * / on numbers, nothing else (no eval)."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](walk(node.operand))
        raise ValueError("only numbers and + - * / are supported")

    try:
        value = walk(ast.parse(str(expression)[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.10g}"


def chat(messages: list[dict]) -> dict:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps(
            {"model": os.environ["ASYNCGRPO_MODEL"], "messages": messages, "tools": [CALCULATOR]}
        ).encode(),
        headers={
            "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["choices"][0]["message"]


def tool_results(message: dict) -> list[dict]:
    results = []
    for call in message.get("tool_calls") or []:
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except ValueError:
            args = {}
        if call["function"]["name"] == "calculator" and isinstance(args, dict):
            content = evaluate(args.get("expression", ""))
        else:
            content = f"error: unknown tool {call['function']['name']!r}"
        results.append({"role": "tool", "tool_call_id": call.get("id"), "content": content})
    return results


def boxed(text: str) -> str | None:
    found = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    return found[-1].strip() if found else None


def main() -> int:
    row = json.loads(sys.stdin.readline())
    prompt = row["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    reply = chat(messages)
    results = tool_results(reply)
    if results:
        messages += [reply, *results]
        try:
            reply = chat(messages)
        except urllib.error.HTTPError as e:  # e.g. the conversation no longer fits: keep the first answer
            print(f"turn 2 refused: {e.read().decode(errors='replace')[:300]}", file=sys.stderr)
    if "solution" in row:
        print(
            json.dumps({"reward": float(boxed(reply.get("content") or "") == str(row["solution"]).strip())})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
