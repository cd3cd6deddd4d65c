"""The ``calculator`` tool: evaluates an arithmetic expression without ``eval``.

Walks Python's AST and allows only numbers, ``+ - * / // % **``, unary signs and parentheses; exponents are
bounded (|exponent| <= 64) and so is the size of every intermediate value (1e30), so a policy cannot stall the
rollout process with ``9**9**9``. A result that is a whole number prints without a decimal point (``888``, not
``888.0``), which is what the quickstart's reward compares.
"""

from __future__ import annotations

import ast
import operator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30
MAX_LENGTH = 200


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        value = _BINARY[type(node.op)](left, right)
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("the result is too large")
        return value
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")


def format_number(value: float | int) -> str:
    """``888`` for whole numbers, else up to 10 significant digits (``0.3333333333``)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: An arithmetic expression using numbers, + - * / // % ** and parentheses, e.g. "37 * 24 + 5".

    Returns:
        The value of the expression.
    """
    text = str(expression).replace("×", "*").replace("÷", "/").replace("^", "**").strip()
    if len(text) > MAX_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    return format_number(_eval(tree.body))
