"""A reward that runs generated code: the response's Python arithmetic expression must reach a target.

The response ends in `#### <expression>`, e.g. `#### 3*5-4` for "make 11 from 3 5 4" (the synthetic
`countdown` task, data_source "rlflow/countdown"). The ground truth is `{"target": 11, "numbers":
[3, 5, 4]}` (a dict or its JSON text; every number used exactly once, as in TinyZero's countdown) or
a bare target number (any expression reaching it).

Checks before running: the expression must parse as Python, use only numbers, + - * / // % ** and
parentheses (no names, calls or attributes, so builtins are moot), and be at most MAX_EXPR_CHARS long.
It then runs in the sandbox with no builtins: arithmetic alone can still take forever or exhaust memory
(`9**9**9` has 370 million digits), which is what the timeout and the memory cap are for.

Scores: 1.0 when the value is the target, else 0.0, with a per-row "status" saying why. A timeout, a
memory blow-up, a crash or an exception (ZeroDivisionError) in the generated expression is the model's
doing: it scores 0.0 and is counted under its status, so a run can watch e.g. "timeout" rates. A bad
ground truth (no target) is a broken dataset and raises; a sandbox that cannot start raises too.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Sequence
from typing import Any

from engine.rewards.sandbox import SandboxJob, run_sandboxed
from engine.rewards.types import RewardItem, RowFailure, SandboxLimits

MAX_EXPR_CHARS = 200
_ALLOWED_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
    ast.UAdd,
    ast.USub,
)


def parse_target(ground_truth: Any) -> tuple[float, list[int] | None]:
    """(target, numbers that must each be used once, or None) from a dict, its JSON text, or a number."""
    spec = ground_truth
    if isinstance(spec, str):
        spec = json.loads(spec)  # "11" -> 11; '{"target": ..}' -> dict; anything else raises
    if isinstance(spec, dict):
        target, numbers = spec["target"], spec.get("numbers")
    else:
        target, numbers = spec, None
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target):
        raise ValueError(f"the target must be a finite number, got {target!r}")
    if numbers is not None and not (isinstance(numbers, list) and all(type(n) is int for n in numbers)):
        raise ValueError(f"'numbers' must be a list of integers, got {numbers!r}")
    return float(target), numbers


def extract_expression(response: str) -> str | None:
    """The text after the last `####` up to the end of its line; None when there is none."""
    if "####" not in response:
        return None
    expression = response.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    return expression or None


def check_expression(expression: str, numbers: list[int] | None) -> str | None:
    """Why the expression may not run ("syntax", "not_arithmetic", ...), or None when it may."""
    if len(expression) > MAX_EXPR_CHARS:
        return "too_long"
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "syntax"
    nodes = list(ast.walk(tree))
    if not all(isinstance(node, _ALLOWED_NODES) for node in nodes):
        return "not_arithmetic"
    constants = [node.value for node in nodes if isinstance(node, ast.Constant)]
    values = [c for c in constants if isinstance(c, (int, float)) and not isinstance(c, bool)]
    if len(values) != len(constants):
        return "not_arithmetic"  # strings, bytes, complex, True/None
    if numbers is not None and sorted(values) != sorted(numbers):
        return "wrong_numbers"
    return None


def python_expr_reward(items: Sequence[RewardItem], limits: SandboxLimits) -> list[dict[str, Any]]:
    """Score every item; the expressions that pass the checks run in one sandboxed batch."""
    targets = []
    for i, item in enumerate(items):
        try:
            targets.append(parse_target(item.ground_truth))
        except (ValueError, KeyError, TypeError) as err:
            raise RowFailure(i, err) from err

    outcomes: list[dict[str, Any]] = [{"score": 0.0, "status": "no_answer"} for _ in items]
    to_run: list[tuple[int, str]] = []
    for i, item in enumerate(items):
        expression = extract_expression(item.response)
        if expression is None:
            continue
        reason = check_expression(expression, targets[i][1])
        if reason is None:
            to_run.append((i, expression))
        else:
            outcomes[i]["status"] = reason

    results = run_sandboxed([SandboxJob(expr) for _, expr in to_run], limits)
    for (i, _), result in zip(to_run, results):
        if result.status == "ok":
            right = _close(result.value, targets[i][0])
            outcomes[i] = {"score": 1.0 if right else 0.0, "status": "right" if right else "wrong"}
        else:
            outcomes[i]["status"] = result.status  # error, timeout, memory, crashed
    return outcomes


def _close(value: Any, target: float) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isclose(value, target, rel_tol=1e-9, abs_tol=1e-9)
    except OverflowError:  # an int too large for a float is not the target
        return False
