"""`rlflow engine list | stop RUN_ID`: the persistent rank actors of each run on the Ray cluster."""

from __future__ import annotations

import argparse
import os


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("engine", help="the persistent engine actors on Ray")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    ls = verbs.add_parser("list", help="runs with live worker groups, their roles and ranks")
    ls.add_argument("--address", help="Ray address (default: RAY_ADDRESS or the local stack)")
    ls.set_defaults(func=_list)
    stop = verbs.add_parser("stop", help="kill the worker groups of a run (or of every run: --all)")
    stop.add_argument("run_id", nargs="?")
    stop.add_argument("--all", action="store_true", help="every live engine on the cluster")
    stop.add_argument("--address", help="Ray address (default: RAY_ADDRESS or the local stack)")
    stop.set_defaults(func=_stop)


def connect(address: str | None) -> bool:
    """Join the Ray cluster as a driver: --address, RAY_ADDRESS, or the local stack's head. True when this
    call joined (the command leaves again at its end); False when this process already is a driver of that
    cluster (a process that ran `rlflow train` before, as tests/warm_cli.py's): its connection is used as
    it is, and kept."""
    import ray

    from engine.errors import EngineError
    from engine.workers.group import NAMESPACE

    target = address or os.environ.get("RAY_ADDRESS") or _stack_address()
    if not target:
        raise EngineError("no Ray cluster to connect to: start one with `rlflow up`, or pass --address")
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if current != target:
            raise EngineError(f"this process is a driver of the Ray cluster at {current}, not of {target}: "
                              "run `rlflow engine` in a process of its own")
        return False
    try:
        ray.init(address=target, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as err:
        raise EngineError(f"cannot reach the Ray cluster at {target}: {err}") from None
    return True


def _leave(joined: bool) -> None:
    """Leave the cluster that `connect` joined, so that a later command of this process (a run) joins it
    with its own settings."""
    if joined:
        import ray

        ray.shutdown()


def _stack_address() -> str | None:
    """The local stack's Ray head, with its connection settings (auth token) applied to this process."""
    from infra.stack import LocalStack, apply_connect_env

    status = LocalStack().status()
    if not status.running:
        return None
    info = status.info()
    apply_connect_env(info)
    return info.ray_address


def _list(args: argparse.Namespace) -> int:
    from engine.workers.group import engine_namespaces

    joined = connect(args.address)
    try:
        return _print_engines(engine_namespaces())
    finally:
        _leave(joined)


def _print_engines(spaces: dict[str, list[str]]) -> int:
    from rich.console import Console
    from rich.table import Table

    from engine.workers.group import NAMESPACE, list_engines

    for run_id, held in _leftovers(spaces).items():
        print(f"{run_id}: placement group(s) of {', '.join(held)} without a live rank hold CPUs "
              f"(`rlflow engine stop {run_id}` frees them)")
    if not spaces:
        print("no live engines")
        return 0
    table = Table("run id", "role", "ranks", "nodes (of the ranks, in order)")
    for namespace in sorted({ns for found in spaces.values() for ns in found}):
        for run_id, roles in list_engines(namespace).items():
            for role, ranks in roles.items():
                table.add_row(run_id, role, ", ".join(map(str, ranks)), _rank_nodes(run_id, role, namespace))
    Console().print(table)
    for run_id, namespaces in spaces.items():  # a run whose ray.namespace is not the default
        for namespace in namespaces:
            if namespace != NAMESPACE:
                print(f"{run_id}: in Ray namespace {namespace} (ray.namespace)")
    return 0


def _leftovers(spaces: dict[str, list[str]]) -> dict[str, list[str]]:
    """Placement groups of runs without a live rank in that role: CPUs held for nothing."""
    from engine.workers.group import engine_placement_groups, list_engines

    live = {(run_id, role) for ns in {n for found in spaces.values() for n in found}
            for run_id, roles in list_engines(ns).items() for role in roles}
    return {run_id: [r for r in roles if (run_id, r) not in live]
            for run_id, roles in engine_placement_groups().items() if any((run_id, r) not in live for r in roles)}


def _rank_nodes(run_id: str, role: str, namespace: str) -> str:
    """The Ray node (first 12 hex digits of its id) each rank runs on, or why it is not known."""
    from engine.errors import EngineError
    from engine.workers.group import WorkerGroup

    try:
        pings = WorkerGroup.attach(run_id=run_id, role=role, config_hash=None, namespace=namespace).health()
    except EngineError as err:
        return f"not reachable: {err}"
    return ", ".join(p.get("node_id", "?")[:12] for p in pings)  # "?": a rank of an older rlflow


def _stop(args: argparse.Namespace) -> int:
    from engine.errors import EngineError

    if bool(args.run_id) == args.all:
        raise EngineError("rlflow engine stop: give a run id or --all (not both)")
    joined = connect(args.address)
    try:
        return _stop_engines(None if args.all else args.run_id)
    finally:
        _leave(joined)


def _stop_engines(run_id: str | None) -> int:
    """Stop the engine of `run_id`, or every engine (None)."""
    from engine.workers.group import (
        NAMESPACE,
        check_run_id,
        engine_namespaces,
        engine_placement_groups,
        stop_engine,
    )

    spaces = engine_namespaces()  # every namespace: a run's ray.namespace is not known here
    for found in engine_placement_groups():  # a run whose ranks are all dead still holds its CPUs
        spaces.setdefault(found, [NAMESPACE])
    if run_id is None:
        for found, namespaces in sorted(spaces.items()):
            roles = sorted({role for ns in namespaces for role in stop_engine(found, ns)})
            print(f"stopped {found}: {', '.join(roles)}")
        if not spaces:
            print("no live engines")
        return 0
    run_id = check_run_id(run_id)
    roles = sorted({role for ns in spaces.get(run_id, []) for role in stop_engine(run_id, ns)})
    print(f"stopped {run_id}: {', '.join(roles)}" if roles else f"no live engine for run {run_id!r}")
    return 0 if roles else 1
