"""`rlflow runs list` / `rlflow runs show RUN_ID`: what is in storage."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flows.config import load_config
from infra.errors import StoreError
from infra.runs import RunStore, RunSummary, list_runs
from infra.store import ObjectStore


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("runs", help="list the runs in storage, or show one")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    ls = verbs.add_parser("list", help="every run under the storage root")
    show = verbs.add_parser("show", help="iterations, checkpoints, buffers and bytes of one run")
    show.add_argument("run_id", metavar="RUN_ID")
    for p in (ls, show):
        p.add_argument("--root", help="storage root URL (default: storage.root of the config)")
        p.add_argument("--config", help="config file for storage settings (default: configs/tiny_grpo.yaml)")
    ls.set_defaults(func=_list)
    show.set_defaults(func=_show)


def _store(args: argparse.Namespace) -> ObjectStore:
    cfg = load_config(args.config)
    store = ObjectStore.from_config(cfg.storage, root=args.root)
    if store.protocol == "file" and not Path(store.root).is_dir():  # a typo must not read as "no runs"
        raise StoreError(f"storage root {store.root!r} is not a folder")
    return store


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _opt(value: object) -> str:
    """A stored value as plain text: no rich markup ("[/x]" raised MarkupError) and no control characters
    (a terminal escape in run.json): whoever writes the bucket writes these."""
    if value is None:
        return "-"
    return escape("".join(c if c.isprintable() else "?" for c in str(value)))


def _list(args: argparse.Namespace) -> int:
    store = _store(args)
    runs = [RunStore(store, r).summary() for r in list_runs(store)]
    console = Console()
    if not runs:
        console.print(f"no runs under {store.root}")
        return 0
    table = Table(title=f"runs under {store.root}")
    for col in ("run", "created", "iterations", "last iter", "checkpoint", "buffers", "size", "writer"):
        table.add_column(col)
    for s in runs:
        table.add_row(
            s.run_id,
            _opt(s.created),
            str(s.iterations_done),
            _opt(s.last_iteration),
            _opt(s.latest_checkpoint),
            str(len(s.buffers)),
            human_bytes(s.bytes_total),
            _opt(s.lease),
        )
    console.print(table)
    return 0


def _show(args: argparse.Namespace) -> int:
    store = _store(args)
    run = RunStore(store, args.run_id)
    summary = run.summary()
    if summary.bytes_total == 0 and not run.exists():
        from infra.errors import StoreError

        raise StoreError(f"no run {args.run_id!r} under {store.root}")
    _print_summary(Console(), summary, run.read_run_info() if run.exists() else {})
    return 0


def _print_summary(console: Console, s: RunSummary, info: dict | None = None) -> None:
    head = Table.grid(padding=(0, 2))
    head.add_row("run", s.run_id)
    head.add_row("where", s.url)
    head.add_row("created", _opt(s.created))
    if info:  # run.json: the lineage
        parent = info.get("parent")
        head.add_row("parent", f"{_opt(parent['run_id'])} step {parent['step']} ({_opt(parent['checkpoint'])})"
                     if parent else "- (a new run)")
        head.add_row("config hash", _opt(info.get("config_hash")))
        head.add_row("code version", _opt(info.get("code_version")))
    head.add_row("iterations done", f"{s.iterations_done} (last: {_opt(s.last_iteration)})")
    head.add_row("latest checkpoint", _opt(s.latest_checkpoint))
    head.add_row("committed checkpoints", ", ".join(map(str, s.checkpoints)) or "-")
    if s.uncommitted_checkpoints:
        head.add_row("uncommitted (ignored)", ", ".join(map(str, s.uncommitted_checkpoints)))
    head.add_row("exports", ", ".join(map(str, s.exports)) or "-")
    head.add_row("writer lease", _opt(s.lease))
    head.add_row("bytes on storage", human_bytes(s.bytes_total))
    console.print(head)
    if s.buffers:
        table = Table(title="buffers")
        table.add_column("iteration", justify="right")
        table.add_column("buffers")
        table.add_column("size", justify="right")
        by_iter: dict[int, list] = {}
        for b in s.buffers:
            by_iter.setdefault(b.iteration, []).append(b)
        for iteration, items in sorted(by_iter.items()):
            table.add_row(
                str(iteration), ", ".join(b.name for b in items), human_bytes(sum(b.size for b in items))
            )
        console.print(table)
