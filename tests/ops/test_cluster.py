"""A real multi-node Ray cluster on this machine: a stack whose head runs no rank (`rlflow up --num-cpus 0`)
and worker nodes that joined it (`rlflow up --join`), each its own raylet, object store and resources,
on 127.0.0.1 only. Storage is the dev S3 server, as a cluster needs. The flow process is a driver
outside the engine's nodes.

Each run ends bit-identical to the single-node uninterrupted run of tests/ops/test_faults.py (the
session's `reference`: same ranks, same seeds, same prompts)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.ops.test_faults import ITERATIONS, REWARD, args
from tests.services import Cli, quiet_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass
class Cluster:
    head_home: Path
    address: str
    token: Path
    nodes: list[Any]  # LocalStack of each joined node, in the order they joined
    cli: Cli

    def join(self, home: Path) -> Any:
        from infra.config import StackConfig
        from infra.stack import LocalStack

        node = LocalStack(StackConfig(home=str(home), join=self.address, num_cpus=2, join_token_file=str(self.token)))
        node.up()
        self.nodes.append(node)
        return node


@pytest.fixture(scope="module")
def cluster(cli: Cli, s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from infra.config import StackConfig
    from infra.stack import LocalStack, token_path

    head_home = tmp_path_factory.mktemp("head")
    head = LocalStack(StackConfig(home=str(head_home), prefect_port=quiet_port(), ray_port=quiet_port(), num_cpus=0))
    head.up()
    address = head.status().info().ray_address
    found = Cluster(head_home, address, token_path(head_home), [],
                    Cli({**cli.env, **s3_server.env, "RLFLOW_HOME": str(head_home)}))
    try:
        for i in range(2):
            found.join(tmp_path_factory.mktemp(f"node{i}"))
        yield found
    finally:
        for node in found.nodes:
            node.down()
        head.down()


def s3_weights(s3_server: Any, prefix: str, run_id: str) -> dict:
    import s3fs
    from safetensors.torch import load

    fs = s3fs.S3FileSystem(key=s3_server.env["AWS_ACCESS_KEY_ID"], secret=s3_server.env["AWS_SECRET_ACCESS_KEY"],
                           endpoint_url=s3_server.endpoint_url)
    return load(fs.cat(f"{s3_server.bucket}/{prefix}/{run_id}/export/step_{ITERATIONS:06d}/model.safetensors"))


def s3_buffer_times(s3_server: Any, prefix: str, run_id: str) -> dict[str, float]:
    import s3fs

    fs = s3fs.S3FileSystem(key=s3_server.env["AWS_ACCESS_KEY_ID"], secret=s3_server.env["AWS_SECRET_ACCESS_KEY"],
                           endpoint_url=s3_server.endpoint_url)
    found = fs.find(f"{s3_server.bucket}/{prefix}/{run_id}/buffers", detail=True)
    return {path: info["LastModified"].timestamp() for path, info in found.items() if path.endswith(".parquet")}


def assert_same_weights(got: dict, reference: dict) -> None:
    assert got.keys() == reference["weights"].keys()
    for key in got:
        assert bool((got[key] == reference["weights"][key]).all()), key


def rank_nodes(cluster: Cluster, run_id: str) -> list[str]:
    """The node id (12 hex digits) of each policy rank, from `rlflow engine list`."""
    listed = cluster.cli("engine", "list")
    assert listed.returncode == 0, listed.stderr[-2000:]
    row = next(line for line in listed.stdout.splitlines() if run_id in line)
    return [part.strip() for part in row.split("│")[4].split(",")]


def worker_node_ids(cluster: Cluster) -> set[str]:
    from infra.stack import cluster_nodes

    return {n.node_id[:12] for n in cluster_nodes(cluster.address, str(cluster.token)) if n.alive and not n.head}


def test_refused_local_root_on_a_cluster(cluster: Cluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    proc = cluster.cli("train", *args(tiny_model_dir, str(root), "local-on-cluster"))
    assert proc.returncode != 0
    assert (f"rlflow: error: storage.root={root} is a local folder and the Ray cluster has 3 nodes: use an object "
            "store (s3://bucket/prefix), or set storage.shared_fs=true") in proc.stderr, proc.stderr[-2000:]
    assert not root.exists()  # refused before anything was written


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


class Watched:
    """A `rlflow train` in the background on the cluster, its output read as it comes."""

    def __init__(self, cluster: Cluster, *train_args: str) -> None:
        self.proc = cluster.cli.popen("train", *train_args)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout or []), daemon=True)
        self.reader.start()

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, what: str, found: Any, timeout_s: float = 240) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (got := found()):
            assert self.proc.poll() is None, f"the run ended ({self.proc.returncode}) before {what}:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s:\n{self.output()[-4000:]}"
            time.sleep(0.2)
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.reader.join(timeout=10)


def node_of_the_stopped_rank(cluster: Cluster, run: Watched) -> Any:
    """The node whose rank has stopped itself mid-update (debug.stop_rank_mid_update), once it has."""
    return run.wait_for("stopped rank", lambda: next(
        (n for n in cluster.nodes if any(_state(p) == "T" for p in _descendants(n.status().node.pid))), None))


def lose(cluster: Cluster, node: Any) -> None:
    """SIGKILL every process of `node` (the node runner, its raylet, object store, agents and workers);
    it leaves the cluster."""
    for pid in _descendants(node.status().node.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cluster.nodes.remove(node)
    node.down()  # its state folder forgets the dead node


@pytest.mark.effect_of("trainer.keep_engine", "ray.placement")
def test_lost_node_mid_update_waits_for_a_replacement(cluster: Cluster, tiny_model_dir: Path, s3_server: Any,
                                                      reference: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 1 stops mid-update of iteration 2 (so the update is surely in flight); then its node is lost.
    The run restarts the engine, waits for capacity with a status line, and goes on once a replacement
    node joins: bit-identical to the single-node run, every buffer written before the loss kept as it was.
    Its ranks spread over the two worker nodes (`ray.placement=strict_spread`, the head runs none): the
    engine that finished the run, kept (`trainer.keep_engine=true`), has one rank on the replacement node
    and one on the other (`rlflow engine list` asks each rank; mid-run, rank 0 waits for the stopped one)."""
    start = time.monotonic()
    root = f"s3://{s3_server.bucket}/cluster"
    run = Watched(cluster, *args(tiny_model_dir, root, "lost-node", "ray.placement=strict_spread",
                                 "placement.cpus_per_rank=1", "debug.stop_rank_mid_update=1", "debug.kill_iteration=2",
                                 "trainer.stage_timeout_s=300", "trainer.capacity_timeout_s=300",
                                 "trainer.keep_engine=true"))
    try:
        lost = node_of_the_stopped_rank(cluster, run)  # a worker node (`cluster.nodes` are the joined ones)
        before = s3_buffer_times(s3_server, "cluster", "lost-node")
        lose(cluster, lost)
        run.wait_for("capacity line", lambda: "waiting for capacity: the lost-node/policy workers need 2 ranks of "
                                              "1 CPU each (STRICT_SPREAD): 1 of 2 ranks placeable" in run.output())
        cluster.join(tmp_path_factory.mktemp("replacement"))
        assert run.proc.wait(timeout=300) == 0, run.output()[-4000:]
        kept = rank_nodes(cluster, "lost-node")  # kept after the run: one rank on each worker node alive now,
        assert len(set(kept)) == 2 and set(kept) == worker_node_ids(cluster), kept  # the replacement and the other
    finally:
        run.close()
        cluster.cli("engine", "stop", "lost-node")
    logs = run.output()
    assert "iteration 2: the engine failed (rank 1 " in logs, logs[-3000:]
    after = s3_buffer_times(s3_server, "cluster", "lost-node")
    assert {k: after[k] for k in before} == before  # nothing written before the loss was written again
    assert_same_weights(s3_weights(s3_server, "cluster", "lost-node"), reference)
    print(f"lost node: {time.monotonic() - start:.0f} s")


@pytest.mark.effect_of("trainer.capacity_timeout_s", "placement.cpus_per_rank")
def test_no_capacity_in_time_fails_then_resume_goes_on(cluster: Cluster, tiny_model_dir: Path, s3_server: Any,
                                                      reference: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A node is lost mid-update and none comes back within trainer.capacity_timeout_s: the run fails with
    one line naming the numbers. Once a node has joined, `rlflow train --resume` finishes the run
    bit-identical to the single-node run."""
    root = f"s3://{s3_server.bucket}/cluster"
    run = Watched(cluster, *args(tiny_model_dir, root, "no-capacity", "ray.placement=strict_spread",
                                 "placement.cpus_per_rank=1", "debug.stop_rank_mid_update=1", "debug.kill_iteration=2",
                                 "trainer.capacity_timeout_s=15"))
    try:
        lose(cluster, node_of_the_stopped_rank(cluster, run))
        assert run.proc.wait(timeout=240) != 0
    finally:
        run.close()
    logs = run.output()
    assert ("rlflow: error: the no-capacity/policy workers could not be placed within 15 s "
            "(trainer.capacity_timeout_s): 2 ranks of 1 CPU each (STRICT_SPREAD): 1 of 2 ranks placeable on the "
            "alive nodes; add nodes, then resume the run") in logs, logs[-4000:]
    cluster.join(tmp_path_factory.mktemp("back"))
    resumed = cluster.cli("train", "--resume", "no-capacity", f"storage.root={root}", REWARD)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_weights(s3_weights(s3_server, "cluster", "no-capacity"), reference)
