"""reasoning-gym's procedural tasks as prompt data in verl's layout (the optional extra `reasoning-gym`).

    train, val = make_reasoning_gym_rows("chain_sum", n=512, val_n=256, seed=0, options={"max_terms": 3})

One row:

    {"data_source": "reasoning_gym/chain_sum",
     "prompt": [{"role": "user", "content": "<the task's question>\\n\\n" + ANSWER_INSTRUCTION}],
     "ability": "reasoning",
     "reward_model": {"style": "rule", "ground_truth": "<the entry's answer>"},
     "extra_info": {"task": "chain_sum", "options": '{"max_terms": 3}', "seed": 0, "size": 1792,
                    "index": 7, "split": "train", "entry": '<the whole entry as JSON text>'}}

`extra_info` is what engine.rewards.reasoning_gym needs to call the task's own verifier,
`dataset.score_answer(answer, entry)`: the dataset is rebuilt from (task, options, seed, size), the
entry read back from its JSON text. Entry `index` is `reasoning_gym.create_dataset(task, seed=seed,
size=size, **options)[index]`, so a row can be checked against the library by hand.

`shots=K` puts K worked examples of the same task before the question, as earlier turns of the chat
(the example's question with the instruction, then `<answer>its answer</answer>` as the assistant's
reply): K drawn for each row (seeded by the dataset's seed and the row's index) from a pool of POOL_PER_SHOT * K examples taken
from the dataset's last indices, so their questions are in neither split. One fixed pair for every row
taught SmolLM2-135M-Instruct to copy the pair's answers (0 of 64 right on basic_arithmetic when both
were negative). A small instruct model rarely writes the tags from the instruction alone (SmolLM2-135M-Instruct:
0 of 64 on chain_sum); after two examples nearly every response has them (README, "A real model on a
real task").

Train and validation come from one dataset: train is indices 0..n-1 (past any whose question is a worked
example's), validation the next indices whose
question is neither a train question nor an earlier validation one (a task with few distinct questions is
refused when it cannot give `val_n` of them), so the two never share a question. reasoning-gym seeds
entry i with `seed + i`: runs with seeds S and S+1 share most of their entries; use seeds far apart.

reasoning_gym is imported only here and in the reward, when called: the core install does not need it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import random
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.errors import DataError

DATA_SOURCE_PREFIX = "reasoning_gym/"
ABILITY = "reasoning"
# What the prompt asks for, and what engine.rewards.reasoning_gym extracts (the last such pair of tags).
ANSWER_INSTRUCTION = "Give your final answer between <answer> and </answer>, with nothing else inside the tags."
INSTALL_HINT = "pip install -e '.[reasoning-gym]' (reasoning-gym==0.1.25)"
# Tasks made on request but refused, with why.
REFUSED_TASKS = {
    "gsm_symbolic": "its question templates come from GSM-Symbolic, whose licence is unclear",
    "composite": "it mixes other tasks through a list of dataset specs, which --option key=value cannot give; "
                 "make each task's files and list them in data.train_files",
}
# Settings of the dataset that the command's own arguments give.
OWN_ARGUMENTS = {"seed": "--seed", "size": "--n and --val-n"}
# How many dataset indices past the train rows may be tried for distinct validation questions, per row asked.
VAL_TRIES_PER_ROW = 8


def import_reasoning_gym() -> types.ModuleType:
    """The reasoning_gym package, or a DataError saying which extra installs it."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise DataError(f"reasoning-gym tasks need the reasoning-gym package, which is not installed ({err}); "
                        f"install it with: {INSTALL_HINT}") from None
    return reasoning_gym


def task_names() -> list[str]:
    """Every task name reasoning-gym registers (the refused ones included)."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS  # filled when reasoning_gym is imported

    return sorted(DATASETS)


def check_task(task: str) -> None:
    """A DataError unless `task` is a reasoning-gym task rlflow makes data for."""
    names = task_names()
    if task in REFUSED_TASKS:
        raise DataError(f"reasoning-gym task {task!r} is refused: {REFUSED_TASKS[task]}")
    if task not in names:
        near = difflib.get_close_matches(task, names, n=4, cutoff=0.5)
        hint = f"nearest: {', '.join(near)}" if near else f"{len(names)} tasks, e.g. {', '.join(names[:4])}"
        raise DataError(f"unknown reasoning-gym task {task!r}; {hint} (`rlflow data tasks` lists them all)")


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """`--option key=value` pairs as a dict; each value is read as YAML (`3`, `true`, `[+, -]`, text)."""
    import yaml

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise DataError(f"--option {pair!r} must be key=value")
        if key in options:
            raise DataError(f"--option {key} is given twice")
        try:
            options[key] = yaml.safe_load(text) if text.strip() else text
        except yaml.YAMLError as err:
            raise DataError(f"--option {key}={text!r} is not a value ({str(err).splitlines()[0]})") from None
    return options


def check_options(task: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options with the task's config types applied (a YAML list for a tuple field as a tuple); an
    unknown key, one the command sets itself, or a value of the wrong type is a DataError naming it."""
    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[task][1]
    fields = [f.name for f in dataclasses.fields(config_cls)]
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # an annotation reasoning-gym cannot resolve itself: its own validation judges
        hints = {}
    checked: dict[str, Any] = {}
    for key, value in options.items():
        if key in OWN_ARGUMENTS:
            raise DataError(f"--option {key} is set by {OWN_ARGUMENTS[key]}, not as an option")
        if key not in fields:
            allowed = [f for f in fields if f not in OWN_ARGUMENTS]
            raise DataError(f"reasoning-gym task {task!r} has no option {key!r}; its options: {', '.join(allowed)}")
        hint = hints.get(key, Any)
        if not _fits(value, hint):
            raise DataError(f"--option {key}={_shown(value)} for reasoning-gym task {task!r}: expected "
                            f"{_type_name(hint)}")
        checked[key] = _as_field(value, hint)
    return checked


def build_dataset(task: str, options: Mapping[str, Any], *, seed: int, size: int) -> Any:
    """`reasoning_gym.create_dataset(task, seed=seed, size=size, **options)`; a config the task refuses
    (its `validate` asserts, a constructor raises) is a DataError naming the options."""
    reasoning_gym = import_reasoning_gym()
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **options)
    except Exception as err:  # AssertionError, ValueError, TypeError...: the library's way to refuse
        raise DataError(f"reasoning-gym task {task!r} refuses {_named(options)}: {_reason(err)}") from None


# At most this many worked examples before each question, drawn from a pool this many times larger.
MAX_SHOTS = 8
POOL_PER_SHOT = 8


def make_reasoning_gym_rows(
    task: str, *, n: int, val_n: int, seed: int, options: Mapping[str, Any] | None = None, shots: int = 0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`n` train and `val_n` validation rows of a reasoning-gym task (module docstring); the same rows for
    the same arguments. Every refusal happens here, before a file is written."""
    if n <= 0 or val_n <= 0:
        raise DataError(f"row counts must be positive, got n={n}, val_n={val_n}")
    if seed < 0:
        raise DataError(f"--seed must be 0 or more for reasoning-gym tasks, got {seed}")
    if not 0 <= shots <= MAX_SHOTS:
        raise DataError(f"--shots must be in 0..{MAX_SHOTS} (worked examples before each question), got {shots}")
    import_reasoning_gym()
    check_task(task)
    options = check_options(task, options or {})
    pool = shots * POOL_PER_SHOT
    size = n + val_n * VAL_TRIES_PER_ROW + pool * VAL_TRIES_PER_ROW
    dataset = build_dataset(task, options, seed=seed, size=size)
    _check_round_trip(dataset, task, _entry(dataset, task, options, 0))
    text = json.dumps(options, sort_keys=True)
    examples = _worked_examples(dataset, task, options, size, pool)

    def row(index: int, split: str) -> dict[str, Any]:
        entry = _entry(dataset, task, options, index)
        made = entry_row(task, entry, {"task": task, "options": text, "seed": seed, "size": size, "index": index,
                                       "split": split, "shots": shots})
        drawn = random.Random(f"{seed}/{index}").sample(range(len(examples)), shots)
        made["prompt"] = [turn for k in drawn for turn in examples[k]] + made["prompt"]
        return made

    asked = {example[0]["content"] for example in examples}
    train: list[dict[str, Any]] = []
    next_index = 0
    while len(train) < n and next_index < size:  # a train question is never a worked example's (rare)
        made = row(next_index, "train")
        next_index += 1
        if made["prompt"][-1]["content"] not in asked:
            train.append(made)
    seen = {r["prompt"][-1]["content"] for r in train} | asked
    val: list[dict[str, Any]] = []
    for index in range(next_index, size - pool * VAL_TRIES_PER_ROW):
        if len(val) == val_n:
            break
        candidate = row(index, "val")
        question = candidate["prompt"][-1]["content"]
        if question not in seen:
            seen.add(question)
            val.append(candidate)
    if len(val) < val_n:
        raise DataError(f"reasoning-gym task {task!r} with {_named(options)} gave only {len(val)} validation questions "
                        f"unlike those of the {n} train rows (and each other) in {size - n} tries, {val_n} asked: its questions "
                        "are too few; lower --n or --val-n, or widen its options")
    return train, val


def entry_row(task: str, entry: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """One reasoning-gym entry as a row in verl's layout; `extra` goes into extra_info beside the entry."""
    answer = entry.get("answer")
    # A task without a single answer (its verifier checks the response itself) has answer None.
    truth = answer if isinstance(answer, str) else "" if answer is None else json.dumps(answer)
    return {
        "data_source": DATA_SOURCE_PREFIX + task,
        "prompt": [{"role": "user", "content": f"{entry['question']}\n\n{ANSWER_INSTRUCTION}"}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {**extra, "entry": json.dumps(entry, sort_keys=True)},
    }


def make_reasoning_gym_files(
    task: str, out_dir: str | os.PathLike[str], *, n: int, val_n: int, seed: int,
    options: Mapping[str, Any] | None = None, shots: int = 0,
) -> tuple[Path, Path]:
    """Write train.parquet and val.parquet of a reasoning-gym task (what `rlflow data make reasoning-gym:TASK`
    does); nothing is written when any check refuses."""
    from engine.data.prompts import write_rows_parquet

    train, val = make_reasoning_gym_rows(task, n=n, val_n=val_n, seed=seed, options=options, shots=shots)
    out = _output_folder(out_dir)
    return write_rows_parquet(train, out / "train.parquet"), write_rows_parquet(val, out / "val.parquet")


def _worked_examples(dataset: Any, task: str, options: Mapping[str, Any], size: int, count: int
                     ) -> list[list[dict[str, str]]]:
    """`count` (user, assistant) pairs of turns from the dataset's last indices, distinct questions with an answer."""
    turns: list[list[dict[str, str]]] = []
    questions: set[str] = set()
    for index in range(size - 1, size - 1 - count * VAL_TRIES_PER_ROW, -1):
        if len(questions) == count:
            break
        entry = _entry(dataset, task, options, index)
        if not isinstance(entry.get("answer"), str) or entry["question"] in questions:
            continue
        questions.add(entry["question"])
        turns.append([{"role": "user", "content": f"{entry['question']}\n\n{ANSWER_INSTRUCTION}"},
                      {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"}])
    if len(questions) < count:
        raise DataError(f"reasoning-gym task {task!r} with {_named(options)} gave only {len(questions)} worked examples "
                        f"with a text answer, {count} asked (the pool of --shots)")
    return turns


def _output_folder(out_dir: str | os.PathLike[str]) -> Path:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file where a folder must be, no permission
        raise DataError(f"cannot make the output folder {str(out)!r}: {err.strerror}") from None
    return out


def _entry(dataset: Any, task: str, options: Mapping[str, Any], index: int) -> dict[str, Any]:
    try:
        entry = dataset[index]
    except Exception as err:  # some configs pass validate() and fail only when an entry is made
        raise DataError(f"reasoning-gym task {task!r} refuses {_named(options)}: making entry {index} raised "
                        f"{_reason(err)}") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("question"), str):
        raise DataError(f"reasoning-gym task {task!r} made entry {index} without a question: {_shown(entry)}")
    try:
        json.dumps(entry)
    except (TypeError, ValueError) as err:
        raise DataError(f"reasoning-gym task {task!r}: entry {index} cannot be stored as JSON ({err})") from None
    return dict(entry)


def _check_round_trip(dataset: Any, task: str, made: dict[str, Any]) -> None:
    """The verifier must score an answer against the stored (JSON) entry as against the one made: arc_agi
    and rearc compare tuples in their metadata, which JSON turns into lists."""
    stored = json.loads(json.dumps(made))
    answer = made.get("answer")
    answer = answer if isinstance(answer, str) else ""
    try:
        same = dataset.score_answer(answer, made) == dataset.score_answer(answer, stored)
    except Exception:  # a verifier that raises on "" for a task without a single answer: not decided here
        return
    if not same:
        raise DataError(f"reasoning-gym task {task!r} is not supported: its verifier scores an entry read back from "
                        "JSON differently from the one it made (its metadata holds tuples)")


def _fits(value: Any, hint: Any) -> bool:
    """Whether a YAML value fits a config field's type; unknown kinds of types are left to the task."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        if not isinstance(value, list):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
        return not args or all(_fits(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return True


def _as_field(value: Any, hint: Any) -> Any:
    if isinstance(value, list) and (typing.get_origin(hint) is tuple or hint is tuple):
        return tuple(value)
    if isinstance(value, int) and not isinstance(value, bool) and hint is float:
        return float(value)
    return value


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    text = str(hint).replace("typing.", "")
    return getattr(hint, "__name__", text) if typing.get_origin(hint) is None else text


def _named(options: Mapping[str, Any]) -> str:
    if not options:
        return "its default options"
    return "the options " + ", ".join(f"{k}={_shown(v)}" for k, v in options.items())


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _shown(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict, tuple)) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
