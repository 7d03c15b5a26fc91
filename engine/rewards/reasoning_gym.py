"""The reward of reasoning-gym rows (data_source `reasoning_gym/<task>`, written by engine.data.reasoning_gym):
the task's own verifier on the answer the response gives between <answer> and </answer>.

- The answer is the text inside the LAST `<answer>...</answer>` pair of the response, stripped of outer
  whitespace (what the prompt's instruction, engine.data.reasoning_gym.ANSWER_INSTRUCTION, asks for). No
  such pair, or one with nothing inside, is no answer: score 0, status "no_answer".
- The score is `dataset.score_answer(answer, entry)`: the task's verifier, with the task's own notion of a
  right answer (chain_sum takes "+01,000.00" for 1000; the library's default gives len(truth)/len(answer)
  when the truth is inside a longer answer). The dataset is rebuilt from the row's task, options, seed and
  size once per process; the entry is read back from the row's JSON text.
- Status "right" when the verifier gives 1.0, "wrong" below it (partial credit keeps its score); "error"
  when the verifier raises on the answer (some do on malformed text: that is the model's doing, scored 0
  and counted, as a sandboxed reward's exception is). A row without its task, options or entry is a
  broken dataset and raises.
- The format component: "format" is 1.0 when the answer tag is there and well formed (the status is not
  "no_answer"), else 0.0; the registry adds `reward.format_weight` x format to the score (default 0: the
  verifier alone).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from engine.rewards.types import RewardItem, RowFailure, SandboxLimits

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(response: str) -> str | None:
    """The stripped text inside the last `<answer>...</answer>` of `response`; None when there is none or
    it is empty."""
    found = _ANSWER.findall(response)
    if not found:
        return None
    answer: str = found[-1].strip()
    return answer or None


@functools.lru_cache(maxsize=32)
def task_dataset(task: str, options_json: str, seed: int, size: int) -> Any:
    """The reasoning-gym dataset a row was made from (its verifier lives on it), built once per process."""
    from engine.data.reasoning_gym import build_dataset, check_options, check_task, import_reasoning_gym

    import_reasoning_gym()
    check_task(task)
    options = json.loads(options_json)
    if not isinstance(options, dict):
        raise ValueError(f"extra_info.options must be a JSON object, got {options_json!r}")
    return build_dataset(task, check_options(task, options), seed=seed, size=size)


def _row_verifier(extra_info: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """(the dataset, the entry) a row's extra_info names; KeyError, TypeError or ValueError when it names none."""
    if not isinstance(extra_info, Mapping):
        raise TypeError("a reasoning_gym row needs extra_info with task, options, seed, size and entry "
                        "(rlflow data make reasoning-gym:TASK writes them)")
    info = extra_info
    dataset = task_dataset(str(info["task"]), str(info["options"]), int(info["seed"]), int(info["size"]))
    entry = json.loads(info["entry"])
    if not isinstance(entry, dict):
        raise ValueError(f"extra_info.entry must be a JSON object, got {str(info['entry'])[:80]!r}")
    return dataset, entry


def reasoning_gym_reward(items: Sequence[RewardItem], limits: SandboxLimits) -> list[dict[str, Any]]:
    """Score every item with its task's verifier (module docstring); `limits` is unused: nothing runs
    generated code here."""
    outcomes: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        try:
            dataset, entry = _row_verifier(item.extra_info)
        except Exception as err:  # a broken row (or reasoning-gym missing): reported with its row, never a 0
            raise RowFailure(i, err) from err
        answer = extract_answer(item.response)
        if answer is None:
            outcomes.append({"score": 0.0, "status": "no_answer", "format": 0.0})
            continue
        try:
            score = float(dataset.score_answer(answer, entry))
        except Exception:  # the verifier choked on the model's text
            outcomes.append({"score": 0.0, "status": "error", "format": 1.0})
            continue
        outcomes.append({"score": score, "status": "right" if score == 1.0 else "wrong", "format": 1.0})
    return outcomes
