"""Deployed runs in the tests: `rlflow deploy` and `rlflow serve` through the real CLI against the
session's stack, and a Prefect client to trigger runs, retry them and read their states."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.services import Cli, WarmCli

REWARD = f"reward.function={Path(__file__).resolve().parents[1] / 'pipeline' / 'rewards.py'}:digit_share"
FLOW = "rlflow-scheduled"
NEVER = "0 3 1 1 *"  # a cron schedule that does not come due during a test: its runs are triggered by hand


def run_args(model: Path, root: Path, *extra: str) -> list[str]:
    """A small run of the tiny model (as tests/pipeline/test_train.py) on one rank: what uses it (deploy,
    serve, the worker, the UI's Retry) is about the flow runs, not the sharding, which the fault and
    engine tests cover on two ranks."""
    return [f"model.path={model}", f"storage.root={root}", REWARD, "trainer.total_iterations=2", "trainer.world_size=1",
            "data.train_batch_size=8", "actor.mini_batch_size=32", "actor.micro_batch_size=32", "trainer.save_every=1", "trainer.val_every=0", "data.train_size=256", "data.val_size=16",
            "rollout.max_new_tokens=8", *extra]


@pytest.fixture(scope="session")
def reference(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted single-node run of tests/ops/test_faults.py's `args`: its final weights and the
    prompt rows of each iteration, what every fault and cluster test must end with."""
    from tests.ops.test_faults import args, sampler_record, weights

    root = tmp_path_factory.mktemp("reference")
    proc = warm_cli("train", *args(tiny_model_dir, str(root), "reference"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"weights": weights(root, "reference"), "record": sampler_record(root, "reference")}


@pytest.fixture(scope="session")
def api_url(stack_home: Path) -> str:
    from infra.config import StackConfig
    from infra.stack import LocalStack

    return LocalStack(StackConfig(home=str(stack_home))).status().info().prefect_api_url


def api_settings(api_url: str, stack_home: Path) -> dict[Any, str]:
    """What a Prefect client of the session's server is given: its address and the stack's auth string."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

    from infra.stack import prefect_auth_path, read_prefect_auth

    return {PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: read_prefect_auth(prefect_auth_path(stack_home))}


@pytest.fixture
def prefect(api_url: str, stack_home: Path) -> Iterator[Any]:
    """A sync Prefect client of the session's server (this process's settings are left as they were)."""
    from prefect import get_client
    from prefect.settings import temporary_settings

    with temporary_settings(updates=api_settings(api_url, stack_home)), get_client(sync_client=True) as client:
        yield client


class Server:
    """`rlflow serve NAME ...` in a subprocess; its output is kept for the failure messages."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.lines = proc, []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "rlflow: serving" in line:
                self.ready.set()

    def tail(self, n: int = 60) -> str:
        return "".join(self.lines[-n:])


@contextmanager
def serving(cli: Cli, names: list[str], home: Path) -> Iterator[Server]:
    """Serve the deployments `names` until the block ends; stopped by its PID (SIGINT, then SIGKILL)."""
    env = {"PREFECT_RUNNER_POLL_FREQUENCY": "2", "PREFECT_HOME": str(home)}
    server = Server(cli.popen("serve", *names, env=env))
    try:
        if not server.ready.wait(120):
            raise AssertionError(f"rlflow serve did not start:\n{server.tail()}")
        yield server
    finally:
        if server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGINT)
            try:
                server.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(server.proc.pid, signal.SIGKILL)
                server.proc.wait()


def trigger(client: Any, name: str) -> Any:
    """A run of deployment `name` now, as the UI's "Quick run" does."""
    deployment = client.read_deployment_by_name(f"{FLOW}/{name}")
    return client.create_flow_run_from_deployment(deployment.id)


def wait_for(client: Any, flow_run_id: Any, done: Callable[[Any], bool], server: Server,
             timeout_s: float = 420) -> Any:
    """Poll the flow run until `done(state)`; fail with the server's output when it takes too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and done(run.state):
            return run
        if time.monotonic() > deadline or server.proc.poll() is not None:
            raise AssertionError(f"flow run {run.name} is {run.state and run.state.name} after "
                                 f"{timeout_s:.0f} s:\n{server.tail()}")
        time.sleep(2)


def subflow_runs(client: Any, parent_id: Any) -> list[Any]:
    """The subflow runs of a flow run, oldest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
    return sorted(runs, key=lambda r: r.created)


def task_states(client: Any, flow_run_id: Any, expect: Iterable[str] = (), timeout_s: float = 60.0) -> dict[str, str]:
    """{task name: state name} of a flow run's task runs (a stage's name without Prefect's `-<n>`), once
    every task named in `expect` is listed in a final state or `timeout_s` have passed. Task runs reach
    the server as events that its recorder writes asynchronously: under load a finished flow run's
    first task runs were seen missing from the list for a while (CI, 2026-12-07)."""
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    deadline = time.monotonic() + timeout_s
    while True:
        runs = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id])))
        states = {r.name.rsplit("-", 1)[0]: r.state for r in runs if r.state is not None}
        if all(name in states and states[name].is_final() for name in expect) or time.monotonic() > deadline:
            return {name: state.name for name, state in states.items()}
        time.sleep(1.0)


def flow_logs(client: Any, flow_run_ids: list[Any]) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=flow_run_ids)))
    return "\n".join(log.message for log in logs)
