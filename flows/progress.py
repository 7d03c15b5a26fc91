"""The console view of a run: a rich progress bar (iteration, reward, step time, ETA) and one line per
iteration. The train flow calls `notify(iteration, metrics)`; listeners are registered by the CLI. The
waits before the first iteration show too: a demo build's phases (`build_progress`) and a stack start
(`phase`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

Listener = Callable[[int, dict[str, float]], None]
ITERATION_FLOW = "rl-iteration"


class QuietIterations(logging.Filter):
    """Console only, at INFO: the per-iteration flow runs' own lines (Prefect's "Beginning subflow run",
    "View at", "Finished in state") and records marked `console=False` (the iteration line the
    progress display already shows) stay out; the Prefect UI gets them all, `--log-level DEBUG` too."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "console", True) is False or getattr(record, "flow_name", None) == ITERATION_FLOW:
            return False
        return not (record.getMessage().startswith("Beginning subflow run")
                    and f"for flow {ITERATION_FLOW!r}" in record.getMessage())


def quiet_console() -> None:
    """Add QuietIterations to the console handlers (stream handlers: Prefect's console handler or the
    CLI's own; Prefect's API handler is not one) of the root and Prefect's run loggers."""
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and not any(
                    isinstance(f, QuietIterations) for f in handler.filters):
                handler.addFilter(QuietIterations())
_LISTENERS: list[Listener] = []


def notify(iteration: int, metrics: dict[str, float]) -> None:
    for listener in list(_LISTENERS):
        listener(iteration, metrics)


def summary_line(iteration: int, m: dict[str, float]) -> str:
    if "actor/dpo_loss" in m:  # algorithm.objective=dpo
        val = f"  val_acc {m['val/preference_accuracy']:.3f}" if "val/preference_accuracy" in m else ""
        return (f"iter {iteration:4d}  loss {m['actor/dpo_loss']:.4f}  acc {m['actor/rewards/accuracy']:.3f}  "
                f"margin {m['actor/rewards/margin']:+.4f}{val}  step {m.get('timing_s/step', 0.0):.1f}s")
    if "actor/sft_loss" in m:  # algorithm.objective=sft
        val = f"  val_loss {m['val/loss']:.4f}" if "val/loss" in m else ""
        return f"iter {iteration:4d}  loss {m['actor/sft_loss']:.4f}{val}  step {m.get('timing_s/step', 0.0):.1f}s"
    val = f"  val {m['val/score/mean']:.3f}" if "val/score/mean" in m else ""
    if "distill/reverse_kl" in m:  # algorithm.objective=distill: the student's reverse KL to the teacher
        val += f"  rkl {m['distill/reverse_kl']:.4f}"
    return (f"iter {iteration:4d}  reward {m.get('critic/score/mean', float('nan')):.3f}{val}  "
            f"len {m.get('response_length/mean', float('nan')):5.1f}  "
            f"pg_loss {m.get('actor/pg_loss', float('nan')):+.4f}  step {m.get('timing_s/step', 0.0):.1f}s")


@contextlib.contextmanager
def console_progress(total: int, live: bool) -> Iterator[None]:
    """A progress bar on a terminal; plain summary lines otherwise (logs, CI)."""
    console = Console()
    if not live:
        def plain(iteration: int, m: dict[str, float]) -> None:
            console.print(summary_line(iteration, m), highlight=False)

        _LISTENERS.append(plain)
        try:
            yield
        finally:
            _LISTENERS.remove(plain)
        return
    bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("reward {task.fields[reward]}  step {task.fields[step]}"),
                   TimeRemainingColumn(), console=console, transient=False)
    task = bar.add_task("train", total=total, reward="-", step="-")

    def update(iteration: int, m: dict[str, float]) -> None:
        bar.console.print(summary_line(iteration, m), highlight=False)
        bar.update(task, completed=iteration, reward=f"{m.get('critic/score/mean', float('nan')):.3f}",
                   step=f"{m.get('timing_s/step', 0.0):.1f}s")

    _LISTENERS.append(update)
    try:
        with bar:
            yield
    finally:
        _LISTENERS.remove(update)


@contextlib.contextmanager
def build_progress(live: bool) -> Iterator[None]:
    """While the block runs, a demo build (engine.demo.progress) shows how far it is: on a terminal a bar per
    phase, otherwise a line when a phase starts, at every tenth of it and when it ends. Nothing shows when
    nothing is built."""
    from engine.demo.progress import reporting

    console = Console()
    bar: Progress | None = None
    tasks: dict[str, Any] = {}
    started: dict[str, float] = {}
    shown: dict[str, int] = {}

    def plain(phase: str, done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if phase not in started:
            started[phase] = time.monotonic()
        elif shown.get(phase) == tenth:
            return
        shown[phase] = tenth
        took = f", {time.monotonic() - started[phase]:.0f} s" if done else ""
        console.print(f"rlflow: {phase} {done}/{total}{took}", highlight=False)

    def live_bar(phase: str, done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), TimeRemainingColumn(), console=console)
            bar.start()
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=total)
        bar.update(tasks[phase], completed=done, total=total)

    try:
        with reporting(live_bar if live else plain):
            yield
    finally:
        if bar is not None:
            bar.stop()


@contextlib.contextmanager
def phase(what: str, live: bool) -> Iterator[None]:
    """A wait without a count (a stack start): a spinner with the time on a terminal, otherwise a line when
    it starts; a line with how long it took when it ends."""
    console = Console()
    start = time.monotonic()
    if live:
        with console.status(f"rlflow: {what}..."):
            yield
    else:
        console.print(f"rlflow: {what}...", highlight=False)
        yield
    console.print(f"rlflow: {what}: {time.monotonic() - start:.1f} s", highlight=False)
