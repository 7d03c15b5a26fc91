"""`rlflow config show [CONFIG] [key=value ...]`: print the resolved config."""

from __future__ import annotations

import argparse

import yaml

from flows.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("config", help="show the resolved config")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    show = verbs.add_parser("show", help="print the config after the file and the overrides")
    show.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
    show.set_defaults(func=_show)


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG] [key=value ...]`: the first argument is a file when it is not key=value."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _show(args: argparse.Namespace) -> int:
    path, overrides = split_config_args(args.args)
    cfg = load_config(path, overrides)
    print(yaml.safe_dump(cfg.public_dict(), sort_keys=False), end="")
    print(f"# config hash: {cfg.config_hash()}")
    return 0
