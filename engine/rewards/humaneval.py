"""The humaneval reward: a response to a HumanEval problem (engine.data.humaneval's rows) runs against the
problem's tests in the sandbox (engine.rewards.sandbox: bubblewrap, reward.sandbox_timeout_s and
reward.sandbox_memory_mb per program); 1.0 when every test passes, else 0.0. Under greedy decoding the mean
over the 164 problems is pass@1.

The program is the problem's own code (its imports and helper functions) followed by, in this order of
preference:
  1. the last fenced code block (```python, ```py or ```) of the response that defines the entry point
     (`def NAME(`): the whole function, which replaces the prompt's stub;
  2. else the first fenced block, else the whole response, as the completion of the prompt's function
     body (HumanEval's own completion format);
then the problem's `check` function and `check(NAME)`.

Status per row: "right" (the tests pass), "wrong" (an assertion of the tests fails), "error" (any other
exception: a syntax error, a NameError...), "timeout", "memory", "crashed" (the sandbox's), "no_answer"
(an empty response). All of those are the model's doing and score 0. A row without its test, entry
point or prompt is a broken dataset and raises; so does a sandbox that cannot start.

Not defended: the tests run in the program's own process, so a program can forge its pass (reach the
test's frames, or write the sandbox's result line to its result pipe and exit). The sandbox confines what a
program reaches, not whether it cheats its own score: fine for measuring a model, a reward-hacking risk
for RL on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from engine.rewards.sandbox import SandboxJob, run_sandboxed
from engine.rewards.types import RewardItem, RowFailure, SandboxLimits

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def parse_problem(ground_truth: Any, extra_info: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """(test code, entry point, the problem's prompt code) of a row; ValueError, KeyError or TypeError when
    the row does not hold them."""
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(truth, Mapping) or not isinstance(extra_info, Mapping):
        raise TypeError("a humaneval row needs ground_truth {test, entry_point} and extra_info {prompt} "
                        "(rlflow data make humaneval writes them)")
    test, entry_point, prompt = truth["test"], truth["entry_point"], extra_info["prompt"]
    if not (isinstance(test, str) and isinstance(prompt, str) and isinstance(entry_point, str)
            and entry_point.isidentifier()):
        raise ValueError(f"test and prompt must be text and entry_point a Python name, got {entry_point!r}")
    return test, entry_point, prompt


def build_program(response: str, prompt: str, entry_point: str, test: str) -> str | None:
    """The program to run for `response` (module docstring); None for an empty response."""
    if not response.strip():
        return None
    blocks = _FENCE.findall(response)
    defines = re.compile(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\(", re.MULTILINE)
    whole = [block for block in blocks if defines.search(block)]
    if whole:
        solution = f"{prompt}\n\n{whole[-1]}"
    else:
        solution = prompt + (blocks[0] if blocks else response)
    return f"{solution}\n\n{test}\n\ncheck({entry_point})\nresult = True\n"


def humaneval_reward(items: Sequence[RewardItem], limits: SandboxLimits) -> list[dict[str, Any]]:
    """Score every item; the programs run in one sandboxed batch, each under `limits`."""
    outcomes: list[dict[str, Any]] = [{"score": 0.0, "status": "no_answer"} for _ in items]
    to_run: list[tuple[int, str]] = []
    for i, item in enumerate(items):
        try:
            test, entry_point, prompt = parse_problem(item.ground_truth, item.extra_info)
        except (ValueError, KeyError, TypeError) as err:
            raise RowFailure(i, err) from err
        program = build_program(item.response, prompt, entry_point, test)
        if program is not None:
            to_run.append((i, program))
    results = run_sandboxed([SandboxJob(code, mode="exec", builtins=True) for _, code in to_run], limits)
    for (i, _), result in zip(to_run, results):
        if result.status == "ok" and result.value is True:
            outcomes[i] = {"score": 1.0, "status": "right"}
        elif result.status == "error":
            outcomes[i]["status"] = "wrong" if result.detail.startswith("AssertionError") else "error"
        else:  # timeout, memory, crashed
            outcomes[i]["status"] = result.status if result.status != "ok" else "error"
    return outcomes
