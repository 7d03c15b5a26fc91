"""A Ray worker node of the local stack: `rlflow up --join 127.0.0.1:PORT` runs this in its own session.

    python -m infra.node --address 127.0.0.1:6379 --num-cpus 2 --resources '{"rlflow_stage": 2}' --temp-dir T

It starts a raylet, an object store and their agents that register with the head's GCS as a new node,
prints READY_LINE, and blocks; SIGTERM stops every process of the node (as `ray start --block` does).

Why not `ray start --address`: the stack's head runs in Ray's single-machine mode so that nothing
listens beyond 127.0.0.1 (infra/stack.py), and `ray start` refuses to add a node in that mode; switching
the mode on replaces 127.0.0.1 by the host's address. Ray's own multi-node-on-one-machine support
(ray.cluster_utils, what Ray's tests run on) starts worker nodes through `ray._private.node.Node`
instead; this does the same, with every port chosen here so that the nodes of one machine never race
for one. Nodes of this kind exist to test clusters on one machine and to add a machine's cores to its
own stack; another machine joins a Ray cluster with `ray start --address` (docs/operations.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from typing import Any

READY_LINE = "rlflow node ready"


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (the stack's services and a node's agents take theirs here)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m infra.node", description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the head's GCS, 127.0.0.1:PORT")
    parser.add_argument("--num-cpus", type=int, required=True)
    parser.add_argument("--resources", default="{}", help="custom resources, JSON")
    parser.add_argument("--temp-dir", required=True)
    parser.add_argument("--object-store-mb", type=int, default=256)
    args = parser.parse_args(argv)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the node IP stays 127.0.0.1 (read at import)
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    ports: dict[str, Any] = {name: free_port() for name in (
        "node_manager_port", "object_manager_port", "metrics_agent_port", "metrics_export_port",
        "dashboard_agent_listen_port", "runtime_env_agent_port")}
    settings: dict[str, Any] = {  # include_log_monitor=False as ray.cluster_utils passes it (one per machine)
        "gcs_address": args.address, "node_ip_address": "127.0.0.1", "num_cpus": args.num_cpus, "num_gpus": 0,
        "resources": json.loads(args.resources), "object_store_memory": args.object_store_mb * 2**20,
        "min_worker_port": 0, "max_worker_port": 0, "include_log_monitor": False, "temp_dir": args.temp_dir, **ports}
    params = RayParams(**settings)
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)

    def stop(*_: Any) -> None:
        node.kill_all_processes(check_alive=False, allow_graceful=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"{READY_LINE}: {node.unique_id} on {args.address}", flush=True)
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    main()
