"""The `rlflow` command line. Each command group lives in flows/commands/<group>.py with a `register`."""

from __future__ import annotations

import argparse
import importlib
import sys

from engine.errors import RLFlowError
from infra.errors import InfraError

# Command groups in the order `rlflow --help` lists them.
COMMAND_MODULES = (
    "flows.commands.train",
    "flows.commands.deploy",
    "flows.commands.stack",
    "flows.commands.config",
    "flows.commands.model",
    "flows.commands.data",
    "flows.commands.infra",
    "flows.commands.runs",
    "flows.commands.engine",
    "flows.commands.doctor",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlflow",
        description="RL post-training for language models as Prefect flows on Ray.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (RLFlowError, InfraError) as err:
        print(f"rlflow: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
