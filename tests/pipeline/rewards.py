"""A reward for pipeline tests that varies within every group (so every update really moves the
weights, even for a barely trained model): the share of digits in the response."""

from __future__ import annotations

from typing import Any


def digit_share(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **_: Any) -> float:
    if not solution_str:
        return 0.0
    return sum(c.isdigit() for c in solution_str) / len(solution_str)


def length_cost(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **_: Any) -> float:
    """A cost for safe RL tests: the response's length in characters over 8 (the tests' max_new_tokens; the
    tiny model's tokenizer has a token per character)."""
    return len(solution_str) / 8
