"""The console view of a run: a rich progress bar (iteration, reward, step time, ETA) and one line per
iteration. The train flow calls `notify(iteration, metrics)`; listeners are registered by the CLI."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

Listener = Callable[[int, dict[str, float]], None]
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
