"""The code-running reward: a generated Python arithmetic expression must reach the target."""

from __future__ import annotations

import json

import pytest

from engine.demo.synthetic import make_rows, solution_text
from engine.errors import RewardError
from engine.rewards import score_batch
from engine.rewards.python_expr import check_expression, extract_expression, parse_target

TRUTH = json.dumps({"target": 11, "numbers": [3, 5, 4]})


@pytest.mark.parametrize(
    ("response", "score", "status"),
    [
        ("#### 3*5-4", 1.0, "right"),
        ("I think\n#### (5 - 4) * 3 + 8 - 8\n", 0.0, "wrong_numbers"),
        ("#### 5*3-4\nmore text", 1.0, "right"),
        ("#### 4-5+3", 0.0, "wrong"),
        ("#### 3*(5-4)/0+0", 0.0, "wrong_numbers"),
        ("#### 11", 0.0, "wrong_numbers"),
        ("#### 3*5-", 0.0, "syntax"),
        ("#### __import__('os').system('true')", 0.0, "not_arithmetic"),
        ("#### (3).real*5-4", 0.0, "not_arithmetic"),
        ("#### '3'*5", 0.0, "not_arithmetic"),
        ("3*5-4", 0.0, "no_answer"),
        ("#### " + "3+" * 200 + "5", 0.0, "too_long"),
    ],
)
def test_countdown_cases(response: str, score: float, status: str) -> None:
    batch = score_batch(["rlflow/countdown"], [response], [TRUTH])
    assert batch.scores == [score] and batch.info == [{"status": status}]


def test_a_bare_target_accepts_any_expression_and_exceptions_score_zero() -> None:
    batch = score_batch(
        ["python_expr/any"] * 4,
        ["#### 2**3+3", "#### 22/2", "#### 1/0", "#### 10"],
        ["11", 11, "11", {"target": 11}],
    )
    assert batch.scores == [1.0, 1.0, 0.0, 0.0]
    assert batch.counts() == {"right": 2, "error": 1, "wrong": 1}


def test_every_synthetic_countdown_solution_scores_one() -> None:
    rows = make_rows("countdown", 40, seed=2)
    batch = score_batch(
        [r["data_source"] for r in rows],
        [solution_text(r) for r in rows],
        [r["reward_model"]["ground_truth"] for r in rows],
    )
    assert batch.scores == [1.0] * 40


@pytest.mark.parametrize(
    ("truth", "why"),
    [
        ("not json", "JSONDecodeError"),
        (json.dumps({"numbers": [1]}), "KeyError: 'target'"),
        (json.dumps({"target": "11"}), "the target must be a finite number, got '11'"),
        (json.dumps({"target": 3, "numbers": [1, "2"]}), "'numbers' must be a list of integers"),
    ],
)
def test_a_bad_ground_truth_fails_with_its_row(truth: str, why: str) -> None:
    with pytest.raises(RewardError) as err:
        score_batch(["rlflow/countdown"] * 2, ["#### 1", "#### 1"], [TRUTH, truth], row_offset=4)
    message = str(err.value)
    assert message.startswith("reward 'python_expr' for data_source 'rlflow/countdown' raised at row 5: ")
    assert why in message


def test_helpers() -> None:
    assert parse_target(" 7 ") == (7.0, None)
    assert parse_target({"target": -2, "numbers": [1, 3]}) == (-2.0, [1, 3])
    assert extract_expression("#### 1 #### 2+2 \n x") == "2+2"
    assert extract_expression("####  \n") is None
    assert check_expression("-3+5*4", [3, 5, 4]) is None
    assert check_expression("True+1", None) == "not_arithmetic"
