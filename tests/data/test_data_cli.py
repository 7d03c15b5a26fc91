"""`rlflow data make`: synthetic train/val parquet files in verl's layout."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from engine.data.prompts import load_prompts
from engine.demo.synthetic import make_rows
from flows.cli import main


@pytest.mark.parametrize("task", ["arith", "sort", "countdown", "calc"])
def test_data_make_writes_readable_parquet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], task: str
) -> None:
    out = tmp_path / "data"
    assert main(["data", "make", task, str(out), "--n", "20", "--val-n", "5", "--seed", "3"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / "train.parquet"), str(out / "val.parquet")]
    train = pd.read_parquet(out / "train.parquet")
    assert len(train) == 20 and len(pd.read_parquet(out / "val.parquet")) == 5
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} <= set(train.columns)
    assert (
        train["reward_model"][0]["ground_truth"] == make_rows(task, 20, 3)[0]["reward_model"]["ground_truth"]
    )
    rows = load_prompts([out / "train.parquet"])
    assert [r.to_record() for r in rows] == make_rows(task, 20, 3, "train")


def test_data_make_unknown_task_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "make", "chess", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "rlflow: error: unknown synthetic task 'chess'; allowed: arith, sort, countdown, calc, guess\n"
    assert main(["data", "make", "arith", str(tmp_path), "--n", "0"]) == 2
    assert "row counts must be positive" in capsys.readouterr().err


def test_data_make_into_a_file_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a_file").write_text("x")
    assert main(["data", "make", "arith", str(tmp_path / "a_file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err == f"rlflow: error: cannot make the output folder '{tmp_path / 'a_file' / 'sub'}': Not a directory\n"
