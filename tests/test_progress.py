"""What the console shows during the waits before a run's first iteration (flows/progress.py)."""

from __future__ import annotations

import re
import time

import pytest

from engine.demo.progress import report
from flows.progress import build_progress, phase


def test_a_wait_without_a_count_says_what_and_how_long(capsys: pytest.CaptureFixture[str]) -> None:
    with phase("the local stack (Prefect server, Ray head)", live=False):
        assert capsys.readouterr().out == "rlflow: the local stack (Prefect server, Ray head)...\n"  # at once
        time.sleep(0.2)
    line = capsys.readouterr().out
    assert re.fullmatch(r"rlflow: the local stack \(Prefect server, Ray head\): (\d+\.\d) s\n", line), line
    assert float(line.split(": ")[-1].removesuffix(" s\n")) >= 0.2


def test_a_build_shows_each_phase_by_tenths_and_nothing_without_a_build(capsys: pytest.CaptureFixture[str]) -> None:
    with build_progress(live=False):
        pass
    assert capsys.readouterr().out == ""
    report("outside", 1, 2)  # no reporter installed: nothing shows, nothing fails
    with build_progress(live=False):
        for done in range(0, 21):
            report("tiny calc model: warm start", done, 20)
        report("tiny calc model: evaluation", 0, 256)
    lines = capsys.readouterr().out.splitlines()
    counts = [line.removeprefix("rlflow: tiny calc model: warm start ").split(",")[0] for line in lines[:-1]]
    assert counts == ["0/20", "2/20", "4/20", "6/20", "8/20", "10/20", "12/20", "14/20", "16/20", "18/20", "20/20"]
    assert lines[-1] == "rlflow: tiny calc model: evaluation 0/256"
