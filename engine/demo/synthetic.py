"""Synthetic prompt tasks in verl's dataset layout, made locally (no hub can be reached here).

Each row:
    {"data_source": "rlflow/arith",
     "prompt": [{"role": "user", "content": "12+345="}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "357"},
     "extra_info": {"index": 0, "split": "train"}}

`solution_text(row)` is the reference response a supervised warm start trains on; the rewards in
engine.rewards score responses of that shape ("#### 357").
"""

from __future__ import annotations

import itertools
import json
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    data_source: str
    ability: str
    make_row: Callable[[random.Random], tuple[str, str]]  # rng -> (prompt text, ground truth)
    solution: Callable[[str], str]  # ground truth -> reference response
    # A task a tool helps with: (prompt text, ground truth) -> the reference response that calls it, as
    # segments (text, trained): the tool's observation is not trained on (the model reads it, never writes it).
    tool_solution: Callable[[str, str], list[tuple[str, bool]]] | None = None
    # A task played against an environment: (ground truth, demonstration index) -> the whole episode as
    # segments (text, trained), every demonstration (the environment's observations not trained on).
    episode: Callable[[str, int], list[tuple[str, bool]]] | None = None


def _arith(rng: random.Random) -> tuple[str, str]:
    # Multi-digit addition; two operands of 1-3 digits keep it learnable by a tiny model on a CPU.
    a = rng.randrange(10 ** rng.randint(1, 3))
    b = rng.randrange(10 ** rng.randint(1, 3))
    return f"{a}+{b}=", str(a + b)


def _sort(rng: random.Random) -> tuple[str, str]:
    # Sort 3-6 digits ascending; the reward gives partial credit per position (another reward shape).
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(3, 6))]
    return f"sort {''.join(digits)}:", "".join(sorted(digits))


def _combine(numbers: tuple[int, ...], ops: tuple[str, ...]) -> int:
    """`a o1 b o2 c` with Python's precedence (`*` before `+`/`-`), without eval."""
    a, b, c = numbers
    apply: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    if ops[1] == "*" and ops[0] != "*":
        return apply[ops[0]](a, b * c)
    return apply[ops[1]](apply[ops[0]](a, b), c)


def _countdown(rng: random.Random) -> tuple[str, str]:
    # Reach a target from three digits with + - * (countdown-like, as in TinyZero). The response is a
    # Python expression, scored by engine.rewards.python_expr in a sandbox: a reward that runs code.
    numbers = tuple(rng.randint(1, 9) for _ in range(3))
    ops = (rng.choice("+-*"), rng.choice("+-*"))
    target = _combine(numbers, ops)
    a, b, c = numbers
    truth = json.dumps({"target": target, "numbers": list(numbers)})
    return f"make {target} from {a} {b} {c}:", truth


def _countdown_solution(truth: str) -> str:
    # The first expression (in a fixed search order) that reaches the target; one always exists
    # because the target was made from one of these orders.
    spec = json.loads(truth)
    for numbers in itertools.permutations(spec["numbers"]):
        for ops in itertools.product("+-*", repeat=2):
            if _combine(numbers, ops) == spec["target"]:
                a, b, c = numbers
                return f"#### {a}{ops[0]}{b}{ops[1]}{c}"
    raise ValueError(f"no expression reaches the target of {truth}")


def _calc(rng: random.Random) -> tuple[str, str]:
    # Four-digit sums: beyond what the tiny model computes, easy with the calculator tool (engine/rollout/builtin_tools.py).
    a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
    return f"{a}+{b}=", str(a + b)


def _calc_with_tool(prompt: str, truth: str) -> list[tuple[str, bool]]:
    """The hermes tool call of the calculator, its observation (not trained on), then the answer."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": prompt.rstrip("=")}}, separators=(",", ":"))
    return [(f"<tool_call>{call}</tool_call>", True), (f"\n<tool_response>\n{truth}\n</tool_response>\n", False),
            (f"#### {truth}", True)]


GUESS_HIGH, GUESS_TURNS = 16, 4  # engine.rollout.builtin_envs.GuessNumber's default range; configs/tiny_guess.yaml's turns


def _guess(rng: random.Random) -> tuple[str, str]:
    # The secret of an episode of engine.rollout.builtin_envs.GuessNumber, which writes the prompt itself.
    return f"guess 1-{GUESS_HIGH}", str(rng.randint(1, GUESS_HIGH))


def _guess_episode(truth: str, index: int) -> list[tuple[str, bool]]:
    """A GuessNumber episode in the tiny model's chat format, up to GUESS_TURNS guesses: the even
    demonstrations bisect on the hints, the odd ones guess numbers not yet tried, ignoring the hints. A
    model warm-started on both uses the hints some of the time; RL should teach it to use them always."""
    secret, low, high = int(truth), 1, GUESS_HIGH
    rng = random.Random(f"guess/{truth}/{index}")
    untried = list(range(1, GUESS_HIGH + 1))
    segments: list[tuple[str, bool]] = []
    for turn in range(GUESS_TURNS):
        guess = (low + high) // 2 if index % 2 == 0 else untried.pop(rng.randrange(len(untried)))
        segments.append((str(guess), True))
        if guess == secret or turn + 1 == GUESS_TURNS:
            break  # the builder adds the eos of the last turn
        hint = "higher" if guess < secret else "lower"
        low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
        segments += [("</s>", True), (f"<|user|>{hint}<|assistant|>", False)]
    return segments


TASKS: dict[str, SyntheticTask] = {
    "arith": SyntheticTask("arith", "rlflow/arith", "math", _arith, lambda gt: f"#### {gt}"),
    "sort": SyntheticTask("sort", "rlflow/sort", "sort", _sort, lambda gt: f"#### {gt}"),
    "countdown": SyntheticTask("countdown", "rlflow/countdown", "math", _countdown, _countdown_solution),
    "calc": SyntheticTask("calc", "rlflow/calc", "math", _calc, lambda gt: f"#### {gt}", _calc_with_tool),
    "guess": SyntheticTask("guess", "rlflow/guess", "game", _guess, str, episode=_guess_episode),
}


def get_task(name: str) -> SyntheticTask:
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; allowed: {', '.join(TASKS)}")
    return TASKS[name]


def make_rows(task: str, n: int, seed: int, split: str = "train") -> list[Row]:
    """`n` rows of `task`, the same for the same (task, n, seed, split)."""
    spec = get_task(task)
    rng = random.Random(f"{task}/{split}/{seed}")
    rows = []
    for i in range(n):
        prompt, truth = spec.make_row(rng)
        rows.append(
            {
                "data_source": spec.data_source,
                "prompt": [{"role": "user", "content": prompt}],
                "ability": spec.ability,
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"index": i, "split": split},
            }
        )
    return rows


def solution_text(row: Row) -> str:
    """The reference response for a synthetic row (what the warm start is trained to produce)."""
    for spec in TASKS.values():
        if spec.data_source == row["data_source"]:
            return spec.solution(row["reward_model"]["ground_truth"])
    raise ValueError(f"row has data_source {row['data_source']!r}, not a synthetic task")


def wrong_solution(row: Row) -> str:
    """A wrong answer of the reference's shape for a sort or arith row (a synthetic preference pair's
    rejected response): the digits in descending order where that differs, else one dropped; the sum plus one."""
    truth = str(row["reward_model"]["ground_truth"])
    if row["data_source"] == TASKS["sort"].data_source:
        return f"#### {truth[::-1] if truth[::-1] != truth else truth[:-1]}"
    if row["data_source"] == TASKS["arith"].data_source:
        return f"#### {int(truth) + 1}"
    raise ValueError(f"no wrong answer for data_source {row['data_source']!r}: synthetic preference pairs are built "
                     "for the sort and arith tasks")
