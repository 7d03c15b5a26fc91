"""`rlflow data make TASK OUT_DIR --n N --seed S [--val-n M]`: write a task's parquet files (a synthetic task,
`reasoning-gym:TASK` with `--option key=value`, or `humaneval`); `rlflow data tasks`: list the tasks."""

from __future__ import annotations

import argparse

from engine.demo.data import make_synthetic_files
from engine.demo.synthetic import TASKS
from engine.errors import DataError

REASONING_GYM = "reasoning-gym:"
HUMANEVAL = "humaneval"


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
    make.add_argument("--n", type=int, default=2000, help="train rows (default 2000)")
    make.add_argument("--val-n", type=int, default=128, help="validation rows (default 128)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                      help="a reasoning-gym task's option (repeatable); the value is read as YAML: 3, true, [+, -]")
    make.set_defaults(func=_make)
    tasks = verbs.add_parser("tasks", help="list the tasks `rlflow data make` takes")
    tasks.set_defaults(func=_tasks)


def _make(args: argparse.Namespace) -> int:
    # Every refusal (an unknown task, a bad count, options a task refuses) raises DataError, which the CLI
    # prints as one line, before anything is written.
    task: str = args.task
    if task.startswith(REASONING_GYM):
        from engine.data.reasoning_gym import make_reasoning_gym_files, parse_options

        train, val = make_reasoning_gym_files(task[len(REASONING_GYM):], args.out_dir, n=args.n, val_n=args.val_n,
                                              seed=args.seed, options=parse_options(args.option))
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
