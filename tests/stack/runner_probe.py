"""Run by test_task_runner.py in a fresh process: two flows on tasks.runner.StageTaskRunner, each
under different Prefect settings, against the running stack.

    python runner_probe.py HOME  ->  one JSON line on stdout

Each flow chains two tasks (the second gets the first's result through Ray); every task reports the
Prefect settings it runs under, its worker's pid and its own task run id, and the server's records of
the task runs are read back afterwards.
"""

from __future__ import annotations

import json
import os
import sys

import ray
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.context import TaskRunContext
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings
from prefect_ray.context import remote_options

from infra.config import StackConfig
from infra.stack import STAGE_RESOURCE, LocalStack, apply_connect_env
from tasks.runner import StageTaskRunner


@task(persist_result=True, cache_policy=None)
def step(previous: int) -> dict:
    return {"value": previous + 1, "retries_setting": PREFECT_CLIENT_MAX_RETRIES.value(), "pid": os.getpid(),
            "task_run_id": str(TaskRunContext.get().task_run.id)}


@flow(task_runner=StageTaskRunner())
def chain(start: int) -> list[dict]:
    with remote_options(num_cpus=0, resources={STAGE_RESOURCE: 1}):
        first = step.submit(start)
        second = step.submit(first.result()["value"])
        return [first.result(), second.result()]


def main(home: str) -> None:
    info = LocalStack(StackConfig(home=home)).status().info()
    apply_connect_env(info)
    ray.init(address=info.ray_address, namespace="rlflow", log_to_driver=False)
    runs = []
    for retries in (3, 7):
        with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: retries}):
            state = chain(retries * 10, return_state=True)
        runs.append({"retries": retries, "flow_run_id": str(state.state_details.flow_run_id),
                     "flow_state": state.type.value, "tasks": state.result()})
    with get_client(sync_client=True) as client:
        for run in runs:
            for t in run["tasks"]:
                record = client.read_task_run(t["task_run_id"])
                t["server_flow_run_id"] = str(record.flow_run_id)
                t["server_state"] = record.state.type.value if record.state else None
    ray.shutdown()
    print(json.dumps(runs))


if __name__ == "__main__":
    main(sys.argv[1])
