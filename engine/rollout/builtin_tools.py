"""Tools that come with rlflow (rollout.multi_turn.tools=engine.rollout.builtin_tools:calculator)."""

from __future__ import annotations

import ast
import operator

from engine.rollout.tools import tool

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.USub: operator.neg}


@tool(description="evaluate an integer arithmetic expression (+ - * // %, parentheses)",
      parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
                  "additionalProperties": False}, pure=True)
def calculator(expression: str) -> str:
    """The value of `expression`, or what is wrong with it (the model reads either)."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return f"error: not an expression: {expression!r}"
    try:
        return str(_value(tree.body))
    except (ValueError, ZeroDivisionError) as err:
        return f"error: {err}"


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 10**30:
            raise ValueError("the product is too large")
        return int(_OPS[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return int(_OPS[type(node.op)](_value(node.operand)))
    raise ValueError(f"only integers and + - * // % are allowed, got {type(node).__name__}")
