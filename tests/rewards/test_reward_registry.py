"""Dispatch on data_source, custom rewards, and every way a reward can fail loudly."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from engine.config import RewardConfig
from engine.errors import RewardError
from engine.imports import load_object
from engine.rewards import (
    REWARDS,
    RewardSpec,
    load_custom_reward,
    per_row,
    register_reward,
    resolve_reward,
    score_batch,
)

CUSTOM = textwrap.dedent(
    """
    import math

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return {"score": float(solution_str == ground_truth), "length": len(solution_str)}

    def raises(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise ZeroDivisionError("the reward divided by zero")
        return 1.0

    def _returning(value):
        def fn(data_source, solution_str, ground_truth, extra_info=None):
            return value if solution_str == "bad" else 0.5
        return fn

    returns_nan = _returning(math.nan)
    returns_inf = _returning(-math.inf)
    returns_str = _returning("0.5")
    returns_none = _returning(None)
    returns_dict_without_score = _returning({"acc": 1.0})
    returns_dict_with_nan = _returning({"score": math.nan})
    returns_bool = _returning(True)
    """
)


@pytest.fixture()
def custom_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    load_object.cache_clear()
    return path


def test_dispatch_on_exact_names_then_longest_prefix() -> None:
    assert resolve_reward("openai/gsm8k").name == "gsm8k"
    assert resolve_reward("rlflow/arith").name == "gsm8k"
    assert resolve_reward("lighteval/MATH").name == "math"
    assert resolve_reward("math/algebra").name == "math"
    assert resolve_reward("gsm8k/platinum").name == "gsm8k"
    assert resolve_reward("rlflow/sort").name == "sort"
    assert resolve_reward("rlflow/countdown").name == "python_expr"


def test_a_batch_of_mixed_sources_keeps_row_order() -> None:
    batch = score_batch(
        ["openai/gsm8k", "rlflow/sort", "lighteval/MATH", "rlflow/exact", "rlflow/arith"],
        ["#### 7", "#### 0132", "\\boxed{\\frac12}", "yes", "#### 8"],
        ["7", "0123", "0.5", "yes", "9"],
    )
    assert batch.scores == [1.0, 0.5, 1.0, 1.0, 0.0]
    assert batch.info == [{}] * 5 and batch.counts() == {}


def test_an_unknown_data_source_lists_the_registered_ones() -> None:
    with pytest.raises(RewardError) as err:
        score_batch(["openai/gsm8k", "acme/trivia"], ["#### 1", "x"], ["1", "x"], row_offset=10)
    message = str(err.value)
    assert message.startswith("no reward for data_source 'acme/trivia' (row 11); registered: ")
    for name in (
        "openai/gsm8k",
        "rlflow/arith",
        "lighteval/MATH",
        "rlflow/sort",
        "rlflow/countdown",
        "math/*",
    ):
        assert name in message
    assert "reward.function" in message


@pytest.mark.effect_of("reward.function")
def test_custom_reward_from_a_file_path(custom_file: Path) -> None:
    cfg = RewardConfig(function=f"{custom_file}:compute_score")
    batch = score_batch(["anything/at-all", "x"], ["abc", "no"], ["abc", "yes"], [{"i": 0}, None], cfg=cfg)
    assert batch.scores == [1.0, 0.0]
    assert batch.info == [{"length": 3}, {"length": 2}]


def test_custom_reward_from_module_and_function(custom_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(custom_file.parent))
    cfg = RewardConfig(function="my_reward:compute_score")
    assert score_batch(["d"], ["abc"], ["abc"], cfg=cfg).scores == [1.0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "must be 'module:function' or 'path/to/file.py:function', got 'no_colon'"),
        ("{dir}/missing.py:f", "no such file"),
        ("{dir}/my_reward.py:nope", "has no function 'nope'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ],
)
def test_a_bad_custom_reward_spec(custom_file: Path, spec: str, message: str) -> None:
    with pytest.raises(RewardError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_custom_reward(spec.format(dir=custom_file.parent))


def test_a_custom_file_that_fails_to_import(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('bad module')\n")
    with pytest.raises(
        RewardError, match=r"broken.py:f'.*importing .*broken.py failed: RuntimeError: bad module"
    ):
        load_custom_reward(f"{path}:f")


@pytest.mark.parametrize(
    ("function", "shown"),
    [
        ("returns_nan", "returned nan at row 12"),
        ("returns_inf", "returned -inf at row 12"),
        ("returns_str", "returned '0.5' at row 12"),
        ("returns_none", "returned None at row 12"),
        ("returns_dict_with_nan", "returned nan at row 12"),
        ("returns_dict_without_score", "returned a dict without 'score' at row 12: {'acc': 1.0}"),
    ],
)
def test_a_reward_returning_a_non_finite_or_non_number_fails(
    custom_file: Path, function: str, shown: str
) -> None:
    cfg = RewardConfig(function=f"{custom_file}:{function}")
    with pytest.raises(RewardError) as err:
        score_batch(["src/a", "src/b", "src/c"], ["ok", "ok", "bad"], ["", "", ""], cfg=cfg, row_offset=10)
    message = str(err.value)
    assert f"reward '{custom_file}:{function}' for data_source 'src/c' {shown}" in message
    assert "a finite number" in message


def test_a_reward_that_raises_fails_with_row_and_exception(custom_file: Path) -> None:
    cfg = RewardConfig(function=f"{custom_file}:raises")
    with pytest.raises(RewardError) as err:
        score_batch(["s", "openai/gsm8k"], ["fine", "boom"], ["", ""], cfg=cfg, row_offset=64)
    assert str(err.value) == (
        f"reward '{custom_file}:raises' for data_source 'openai/gsm8k' raised at row 65: "
        "ZeroDivisionError: the reward divided by zero"
    )
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_bools_are_numbers(custom_file: Path) -> None:
    cfg = RewardConfig(function=f"{custom_file}:returns_bool")
    assert score_batch(["s"], ["bad"], [""], cfg=cfg).scores == [1.0]


def test_a_builtin_reward_with_bad_ground_truth_fails_with_its_row() -> None:
    with pytest.raises(
        RewardError, match=r"reward 'format' for data_source 'rlflow/format' raised at row 1: error: "
    ):
        score_batch(["rlflow/format", "rlflow/format"], ["a", "b"], ["a", "(unclosed"])


def test_registering_a_reward_and_refusing_clashes() -> None:
    spec = RewardSpec(
        "shout", per_row(lambda **kw: float(kw["solution_str"].isupper())), ("acme/shout",), ("shout/",)
    )
    try:
        register_reward(spec)
        assert score_batch(["acme/shout", "shout/x"], ["HEY", "hey"], ["", ""]).scores == [1.0, 0.0]
        with pytest.raises(RewardError, match="already registered"):
            register_reward(spec)
        with pytest.raises(RewardError, match=r"openai/gsm8k already belongs to 'gsm8k'"):
            register_reward(RewardSpec("other", spec.fn, ("openai/gsm8k",)))
    finally:
        REWARDS.pop("shout", None)


def test_columns_of_different_lengths_are_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="columns differ in length"):
        score_batch(["a"], ["x", "y"], ["1", "2"])
