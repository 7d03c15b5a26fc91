"""The console view of a run: a rich progress bar (iteration, reward, step time, ETA) and one line per
iteration. The train flow calls `notify(iteration, metrics)`; listeners are registered by the CLI."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

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
    val = f"  val {m['val/score/mean']:.3f}" if "val/score/mean" in m else ""
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
