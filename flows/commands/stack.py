"""`rlflow up | down | status`: the local stack, a Prefect server and a Ray head node (infra/stack.py)."""

from __future__ import annotations

import argparse
import shlex
import sys

from infra.config import StackConfig
from infra.stack import LocalStack, ServiceStatus, StackStatus, connect_env


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser(
        "up",
        help="start the local stack: Prefect server and Ray head node (what runs is reused)",
        description="Start a Prefect server on 127.0.0.1 (SQLite in the state folder, $RLFLOW_HOME or "
        "~/.rlflow) and a Ray head node, each in the background. What already runs is reused.",
    )
    up.add_argument("--prefect-port", type=int, default=None, metavar="P", help="default: 4200")
    up.add_argument("--ray-port", type=int, default=None, metavar="R", help="default: 6379")
    up.add_argument(
        "--num-cpus", type=int, default=None, metavar="N", help="Ray logical CPUs (default: max(cores, 4))"
    )
    up.add_argument("--join", default=None, metavar="ADDRESS",
                    help="add this state folder to the stack whose Ray head is ADDRESS (127.0.0.1:PORT) as a Ray "
                    "worker node with the stage resource, instead of starting a stack; `rlflow down` leaves")
    up.add_argument("--token-file", default=None, metavar="PATH",
                    help="with --join: the head's Ray token file (default: $RAY_AUTH_TOKEN_PATH)")
    up.set_defaults(func=_up)
    down = sub.add_parser("down", help="stop the local stack (the processes `rlflow up` started)")
    down.set_defaults(func=_down)
    status = sub.add_parser(
        "status", help="what runs where: Prefect UI, Ray address, PIDs, the Ray nodes and their resources "
        "(exit code 1 unless the stack, or the joined node, runs)"
    )
    status.add_argument(
        "--env", action="store_true", help="print `export` lines that point a shell at the stack"
    )
    status.set_defaults(func=_status)


def _config(args: argparse.Namespace) -> StackConfig:
    from pydantic import ValidationError

    from engine.errors import ConfigError
    from flows.config import allowed_range

    chosen = {"prefect_port": args.prefect_port, "ray_port": args.ray_port, "num_cpus": args.num_cpus,
              "join": args.join, "join_token_file": args.token_file}
    try:
        return StackConfig(**{key: value for key, value in chosen.items() if value is not None})
    except ValidationError as err:  # one line naming the option and its range (a traceback before)
        first = err.errors()[0]
        name = str(first["loc"][0])
        allowed = allowed_range(list(StackConfig.model_fields[name].metadata), int)
        flag = "--token-file" if name == "join_token_file" else "--" + name.replace("_", "-")
        raise ConfigError(f"{flag} {chosen[name]} is not allowed: "
                          f"{f'must be {allowed}' if allowed else first['msg']}") from None


def _up(args: argparse.Namespace) -> int:
    from flows.progress import phase

    stack = LocalStack(_config(args))
    print(f"state folder {stack.home}", flush=True)
    with phase("the local stack (Prefect server, Ray head)", sys.stdout.isatty()):
        status = stack.up()
    _print(status)
    return 0


def _down(args: argparse.Namespace) -> int:
    stack = LocalStack()
    lines = stack.down()
    if all(line.endswith(": not running") for line in lines):
        print(f"nothing is running (state folder {stack.home})")
        return 0
    print("\n".join(lines))
    return 0


def _status(args: argparse.Namespace) -> int:
    status = LocalStack().status()
    if args.env:
        info = status.info()
        for key, value in connect_env(info).items():
            if key == "PREFECT_API_AUTH_STRING" and info.prefect_auth_path:  # the shell reads it: never printed
                print(f'export {key}="$(cat {shlex.quote(info.prefect_auth_path)})"')
            else:
                print(f"export {key}={shlex.quote(value)}")
        return 0
    print(f"state folder {status.home}")
    _print(status)
    if status.running:
        info = status.info()
        _print_nodes(info.ray_address, info.ray_token_path)
    elif status.node is not None and status.node.state == "running" and status.node.record is not None:
        _print_nodes(status.node.address or "", status.node.record.token_file)
    return 0 if status.running or (status.node is not None and status.node.state == "running") else 1


def _print_nodes(address: str, token_path: str | None) -> None:
    """The Ray cluster's nodes (alive and dead), from its GCS."""
    from infra.stack import cluster_nodes

    try:
        nodes = cluster_nodes(address, token_path)
    except Exception as err:  # status is a report: the stack lines above stand without the nodes
        print(f"Ray nodes    not listed: {err}")
        return
    print(f"Ray nodes    {sum(n.alive for n in nodes)} alive of {len(nodes)}")
    for node in nodes:
        print(f"  {node.line()}")


def _print(status: StackStatus) -> None:
    if status.node is not None:  # a worker node of another stack
        print(_line(status.node))
        return
    for service in (status.prefect, status.ray):
        print(_line(service))
    if status.prefect.state == "running":
        print(f"Prefect UI   {status.prefect.address.removesuffix('/api') if status.prefect.address else ''}")
    if status.ray.state == "running":
        print(f"Ray address  {status.ray.address}")


def _line(service: ServiceStatus) -> str:
    if service.state == "stopped":
        return f"{service.name:8} stopped"
    parts = [f"{service.name:8} {service.state:9} pid {service.pid:<7} {service.address}"]
    record = service.record
    if service.name in ("ray", "node") and record is not None:
        parts.append(f"{record.num_cpus} CPUs, {record.stage_slots} stage slots, auth {record.auth}")
    if service.name == "prefect" and record is not None:  # where to find the UI's password, never the password
        parts.append(f"auth string in {record.token_file} (the UI asks for it)" if record.auth == "token"
                     else "no auth string (`rlflow down` and `rlflow up` to lock the API)")
    parts.append(service.detail)
    parts.append(f"log {service.log}")
    return "  ".join(parts)
