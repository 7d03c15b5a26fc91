"""Deployments on a Prefect work pool, executed as Prefect users run them: `rlflow deploy --pool NAME`
creates the (process) pool and the deployment, and a `prefect worker start --pool NAME` process, with the
stack's address and Ray token only in its environment (`rlflow status --env`), executes the runs by
the flow's module path: rlflow is installed there, no code is downloaded. A scheduled run that fails
is retried through the call the UI's Retry button makes (tests/ops/test_ui_retry.py presses the real
button on a served run; the button is the same for a worker's run), and the retry, executed by the
worker again, reuses every finished stage of the failed iteration."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from tests.ops.conftest import REWARD, Server, run_args, subflow_runs, task_states, wait_for
from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
POOL = "rlflow-test-pool"
REUSED = ("generate_rollouts", "score_rewards", "compute_old_logprobs", "compute_advantages")
# The update of iteration 2 fails past its retries: the first at once, the second 3 s later.
DELAYS = [0.0, 3.0]
FAULT = ["debug.fail_stage=update_policy", "debug.fail_times=3", "debug.fail_iteration=2",
         f"trainer.stage_retry_delays_s={DELAYS}"]
# An environment plays the rollouts (its reward replaces the rule's): 4 prompts x 4 episodes, two turns each.
ENV = ["rollout.multi_turn.enable=true", "rollout.env=engine.rollout.builtin_envs:GuessNumber",
       "rollout.multi_turn.max_turns=2", "rollout.max_new_tokens=24", "data.max_prompt_length=32",
       "data.train_batch_size=4", "rollout.n=4", "actor.mini_batch_size=8", "actor.micro_batch_size=8"]


class Worker(Server):
    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "started!" in line or "Worker" in line and "started" in line:
                self.ready.set()


@contextmanager
def worker(cli: Cli, stack_home: Path, home: Path) -> Iterator[Worker]:
    """`prefect worker start --pool POOL` with the stack's connection settings in its environment, as
    `eval "$(rlflow status --env)"` would put them; stopped by its PID."""
    from infra.config import StackConfig
    from infra.stack import LocalStack, connect_env

    env = {**cli.env, **connect_env(LocalStack(StackConfig(home=str(stack_home))).status().info()),
           "PREFECT_HOME": str(home), "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_PREFETCH_SECONDS": "2"}
    prefect = str(Path(sys.executable).with_name("prefect"))
    proc = subprocess.Popen([prefect, "worker", "start", "--pool", POOL, "--type", "process"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    found = Worker(proc)
    try:
        if not found.ready.wait(120):
            raise AssertionError(f"the Prefect worker did not start:\n{found.tail()}")
        yield found
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _first_scheduled_run(client: Any, deployment_id: Any, running: Worker, timeout_s: float = 300) -> Any:
    """The first run the schedule made, once the worker started it; the schedule is then paused and the
    runs it made after that one are deleted."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter
    from prefect.exceptions import ObjectNotFound

    def runs() -> list[Any]:
        found = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                                      flow_run_filter=FlowRunFilter())
        return sorted(found, key=lambda r: r.expected_start_time)

    deadline = time.monotonic() + timeout_s
    while not (started := [r for r in runs() if r.start_time is not None]):
        assert time.monotonic() < deadline, f"no scheduled run started:\n{running.tail()}"
        time.sleep(1)
    client.pause_deployment(deployment_id)
    for later in runs():
        if later.start_time is None:
            with contextlib.suppress(ObjectNotFound):
                client.delete_flow_run(later.id)
    return started[0]


def retry_delays(client: Any, flow_run_id: Any, stage: str) -> list[float]:
    """Seconds from each AwaitingRetry of `stage` in iteration 2 of the flow run's train run to when its
    retry was scheduled."""
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    train = subflow_runs(client, flow_run_id)[0]
    iteration = next(r for r in subflow_runs(client, train.id) if r.name == "iter-000002")
    tasks = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[iteration.id])))
    task = next(t for t in tasks if t.name.rsplit("-", 1)[0] == stage)
    waits = [s for s in client.read_task_run_states(task.id) if s.name == "AwaitingRetry"]
    return [(s.state_details.scheduled_time - s.timestamp).total_seconds() for s in sorted(waits, key=lambda s: s.timestamp)]


@pytest.mark.effect_of("trainer.stage_retry_delays_s")
def test_a_worker_executes_a_run_and_its_retry_reuses_finished_stages(
        cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path, prefect: Any, stack_home: Path) -> None:
    from prefect.states import AwaitingRetry

    root = tmp_path / "runs"
    args = [a for a in run_args(tiny_model_dir, root, "trainer.iterations_per_run=2", *FAULT, *ENV) if a != REWARD]
    proc = warm_cli("deploy", *args, "--name", "pooled", "--interval", "15", "--pool", POOL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"`prefect worker start --pool {POOL}` executes its runs" in proc.stdout
    deployment = prefect.read_deployment_by_name("rlflow-scheduled/pooled")
    assert deployment.work_pool_name == POOL and prefect.read_work_pool(POOL).type == "process"
    assert not any(k.startswith(("AWS_", "RAY_")) for k in map(str, deployment.parameters))
    served = warm_cli("serve", "pooled")  # `rlflow serve` would take the deployment off its pool: refused
    assert served.returncode == 2 and "runs on a work pool" in served.stderr, served.stderr[-2000:]
    try:
        with worker(cli, stack_home, tmp_path / "worker-home") as running:
            run = wait_for(prefect, _first_scheduled_run(prefect, deployment.id, running).id,
                           lambda s: s.is_final(), running)
            assert run.state.is_failed(), f"{run.state.name}: {run.state.message}\n{running.tail()}"
            assert run.work_pool_name == POOL and run.auto_scheduled  # made by the schedule, run by the worker
            assert retry_delays(prefect, run.id, "update_policy") == pytest.approx(DELAYS, abs=0.5)
            rollout = root / "pooled" / "buffers" / "iter_000002" / "rollout.parquet"
            before = (rollout.stat().st_mtime_ns, rollout.read_bytes())
            assert prefect.set_flow_run_state(run.id, AwaitingRetry(message="retried")).status.value == "ACCEPT"
            done = wait_for(prefect, run.id, lambda s: s.is_final() and s.name != "AwaitingRetry", running)
            assert done.state.is_completed(), f"{done.state.name}: {done.state.message}\n{running.tail()}"
    finally:
        warm_cli("engine", "stop", "pooled")
    assert done.run_count == 2
    retried = subflow_runs(prefect, run.id)[-1]
    iteration = [r for r in subflow_runs(prefect, retried.id) if r.name == "iter-000002"]
    states = task_states(prefect, iteration[0].id, REUSED)
    assert {stage: states.get(stage) for stage in REUSED} == dict.fromkeys(REUSED, "Cached"), states
    assert (rollout.stat().st_mtime_ns, rollout.read_bytes()) == before  # not regenerated
    assert len(pd.read_parquet(rollout)["env_reward"]) == 16  # the environment's episodes, kept
    assert (root / "pooled" / "metrics" / "iter_000002.json").exists()
