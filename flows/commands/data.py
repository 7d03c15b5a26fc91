"""`rlflow data make TASK OUT_DIR --n N --seed S [--val-n M]`: write a synthetic task's parquet files."""

from __future__ import annotations

import argparse

from engine.demo.data import make_synthetic_files
from engine.demo.synthetic import TASKS


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("data", help="prompt datasets")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    make = verbs.add_parser(
        "make",
        help="write train.parquet and val.parquet of a synthetic task in verl's layout",
        description=f"Synthetic tasks: {', '.join(TASKS)}.",
    )
    make.add_argument("task", metavar="TASK", help=f"one of {', '.join(TASKS)}")
    make.add_argument("out_dir", metavar="OUT_DIR")
    make.add_argument("--n", type=int, default=2000, help="train rows (default 2000)")
    make.add_argument("--val-n", type=int, default=128, help="validation rows (default 128)")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_make)


def _make(args: argparse.Namespace) -> int:
    # An unknown task or a bad count raises DataError, which the CLI prints as one line.
    train, val = make_synthetic_files(args.task, args.out_dir, n=args.n, val_n=args.val_n, seed=args.seed)
    print(train)
    print(val)
    return 0
