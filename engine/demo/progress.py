"""How far a demo build is: the builders call `report(phase, done, total)`; a caller that shows it (the CLI)
installs a reporter with `reporting`. A build in a process of its own prints its reports as lines on
stdout, which the parent hands to its own reporter (`forward`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

Reporter = Callable[[str, int, int], None]  # (phase, done, total)
LINE = "rlflow-build-progress"
_reporters: list[Reporter] = []


@contextmanager
def reporting(reporter: Reporter) -> Iterator[None]:
    """`reporter` gets every report made while the block runs (the innermost reporter only)."""
    _reporters.append(reporter)
    try:
        yield
    finally:
        _reporters.remove(reporter)


def report(phase: str, done: int, total: int) -> None:
    if _reporters:
        _reporters[-1](phase, done, total)


def to_stdout(phase: str, done: int, total: int) -> None:
    """The reporter of a build in a child process: one line per report, for `forward` in the parent."""
    print(f"{LINE}\t{phase}\t{done}\t{total}", flush=True)


def forward(line: str) -> bool:
    """A child's `to_stdout` line: reported here (True); anything else: False."""
    fields = line.rstrip("\n").split("\t")
    if len(fields) != 4 or fields[0] != LINE:
        return False
    report(fields[1], int(fields[2]), int(fields[3]))
    return True
