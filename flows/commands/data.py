"""`rlflow data make TASK OUT_DIR --n N --seed S [--val-n M]`: write a task's parquet files (a synthetic task,
`reasoning-gym:TASK` with `--option key=value`, or `humaneval`); `rlflow data tasks`: list the tasks."""

from __future__ import annotations

import argparse

from engine.demo.data import make_synthetic_files
from engine.demo.synthetic import TASKS
from engine.errors import DataError

REASONING_GYM = "reasoning-gym:"
HUMANEVAL = "humaneval"
DEFAULTS = {"n": 2000, "val_n": 128, "seed": 0}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("data", help="prompt datasets")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    make = verbs.add_parser(
        "make",
        help="write train.parquet and val.parquet of a task in verl's layout",
        description=f"Synthetic tasks: {', '.join(TASKS)}. reasoning-gym tasks: {REASONING_GYM}TASK (the "
        "reasoning-gym extra; `rlflow data tasks` lists them), with the task's options as --option key=value. "
        f"{HUMANEVAL}: OpenAI's 164 HumanEval problems as val.parquet (the humaneval extra).",
    )
    make.add_argument("task", metavar="TASK",
                      help=f"one of {', '.join(TASKS)}; {REASONING_GYM}TASK; {HUMANEVAL}")
    make.add_argument("out_dir", metavar="OUT_DIR")
    # None: not given (humaneval refuses them); the defaults below apply to the other tasks.
    make.add_argument("--n", type=int, default=None, help=f"train rows (default {DEFAULTS['n']})")
    make.add_argument("--val-n", type=int, default=None, help=f"validation rows (default {DEFAULTS['val_n']})")
    make.add_argument("--seed", type=int, default=None, help=f"(default {DEFAULTS['seed']})")
    make.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                      help="a reasoning-gym task's option (repeatable); the value is read as YAML: 3, true, [+, -]")
    make.add_argument("--shots", type=int, default=0, metavar="K",
                      help="reasoning-gym: K worked examples of the task before each question, as earlier chat turns "
                      "(default 0)")
    make.set_defaults(func=_make)
    tasks = verbs.add_parser("tasks", help="list the tasks `rlflow data make` takes")
    tasks.set_defaults(func=_tasks)


def _make(args: argparse.Namespace) -> int:
    # Every refusal (an unknown task, a bad count, options a task refuses) raises DataError, which the CLI
    # prints as one line, before anything is written.
    task: str = args.task
    if task == HUMANEVAL:  # the 164 problems, all of them, as validation
        given = [f"--{k.replace('_', '-')}" for k in DEFAULTS if getattr(args, k) is not None] + \
            ["--option"] * bool(args.option) + ["--shots"] * bool(args.shots)
        if given:
            raise DataError(f"{given[0]} is not a setting of humaneval: its 164 problems are written as "
                            "val.parquet, all of them, in their own order")
        from engine.data.humaneval import make_humaneval_file

        print(make_humaneval_file(args.out_dir))
        return 0
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if task.startswith(REASONING_GYM):
        from engine.data.reasoning_gym import make_reasoning_gym_files, parse_options

        train, val = make_reasoning_gym_files(task[len(REASONING_GYM):], args.out_dir, n=args.n, val_n=args.val_n,
                                              seed=args.seed, options=parse_options(args.option),
                                              shots=args.shots)
    elif args.shots:
        raise DataError(f"--shots is a setting of reasoning-gym tasks ({REASONING_GYM}TASK), not of {task!r}")
    elif args.option:
        raise DataError(f"--option is a setting of reasoning-gym tasks ({REASONING_GYM}TASK), not of {task!r}")
    else:
        train, val = make_synthetic_files(task, args.out_dir, n=args.n, val_n=args.val_n, seed=args.seed)
    print(train)
    print(val)
    return 0


def _tasks(args: argparse.Namespace) -> int:
    print("synthetic:", ", ".join(TASKS))
    print(f"{HUMANEVAL} (the humaneval extra)")
    from engine.data.reasoning_gym import REFUSED_TASKS, task_names

    try:
        names = ", ".join(n for n in task_names() if n not in REFUSED_TASKS)
    except DataError as err:  # not installed: say how to install it
        names = str(err)
    print(f"{REASONING_GYM}TASK (the reasoning-gym extra):", names)
    return 0
