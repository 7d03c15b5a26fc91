"""Rule rewards on hand cases: gsm8k `####`, MATH `\\boxed{}` with normalisation, exact, format, sort."""

from __future__ import annotations

import pytest

from engine.rewards.math_answer import is_equiv, last_boxed, math_score, strip_answer
from engine.rewards.rules import exact_match_score, extract_hash_answer, format_score, gsm8k_score, sort_score


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("so 3+4=7\n#### 7", "7", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### $72", "72", 1.0),
        ("#### 72.0", "72", 1.0),  # verl compares strings and gives 0 here; equal values score
        ("#### 72.", "72", 1.0),
        ("####72", "72", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### 5 then #### 7", "5", 1.0),  # the first answer counts, as in verl's strict mode
        ("#### 71", "72", 0.0),
        ("the answer is 72", "72", 0.0),  # no `####`: the format is part of the reward
        ("#### seven", "7", 0.0),
        ("#### 357", 357, 1.0),  # an integer ground truth
    ],
)
def test_gsm8k(response: str, truth: object, score: float) -> None:
    assert gsm8k_score("openai/gsm8k", response, truth) == score


def test_extract_hash_answer() -> None:
    assert extract_hash_answer("x #### 1,234.5 y") == "1234.5"
    assert extract_hash_answer("no answer") is None


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so \\boxed{5} and finally \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
        ("$\\boxed 7$", "7"),
        ("\\fbox{x}", "x"),
        ("\\boxed{unbalanced", None),
        ("no box", None),
    ],
)
def test_last_boxed(text: str, boxed: str | None) -> None:
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("\\frac12", "\\frac{1}{2}"),
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("-\\frac{3}{4}", "-0.75"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("5\\text{ cm}", "5"),
        ("5.0", "5"),
        ("x = 3", "3"),
        ("10\\%", "10"),
        ("1,000", "1000"),
        ("90^\\circ", "90"),
        ("\\$4.50", "4.5"),
        ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}"),
        ("\\text{yes}", "yes"),
        (".5", "0.5"),
    ],
)
def test_equivalent_answers(answer: str, truth: str) -> None:
    assert is_equiv(answer, truth), (strip_answer(answer), strip_answer(truth))


@pytest.mark.parametrize(
    ("answer", "truth"), [("3", "4"), ("(1,2)", "(2,1)"), ("\\frac{1}{3}", "0.33"), ("1,2", "12")]
)
def test_different_answers(answer: str, truth: str) -> None:
    assert not is_equiv(answer, truth)


def test_math_score() -> None:
    assert math_score("lighteval/MATH", "We get $\\boxed{\\dfrac{1}{2}}$.", "\\frac12") == 1.0
    assert math_score("lighteval/MATH", "\\boxed{1} no wait \\boxed{2}", "2") == 1.0
    assert math_score("lighteval/MATH", "\\boxed{2}", "\\boxed{2}") == 1.0  # a boxed ground truth
    assert math_score("lighteval/MATH", "The answer is 2.", "2") == 0.0
    assert math_score("lighteval/MATH", "\\boxed{3}", "2") == 0.0


def test_exact_match() -> None:
    assert exact_match_score("rlflow/exact", "  Paris\n", "Paris") == 1.0
    assert exact_match_score("rlflow/exact", "Paris.", "Paris") == 0.0


def test_format() -> None:
    pattern = r"<think>.*</think>\s*#### -?\d+"
    assert format_score("rlflow/format", "<think>3+4\n=7</think> #### 7\n", pattern) == 1.0
    assert format_score("rlflow/format", "#### 7", pattern) == 0.0
    assert format_score("rlflow/format", "<think>x</think> #### 7 and more", pattern) == 0.0


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("#### 0123", 1.0),
        ("#### 0132", 0.5),
        ("#### 012", 0.75),  # one position missing
        ("#### 01234", 0.8),  # one position too many
        ("#### 3210", 0.0),
        ("0123", 0.0),  # no `####`
    ],
)
def test_sort_partial_credit(response: str, score: float) -> None:
    assert sort_score("rlflow/sort", response, "0123") == pytest.approx(score)
