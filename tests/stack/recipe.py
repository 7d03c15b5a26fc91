"""The measured recipe: Prefect flows on a RayTaskRunner against the local stack, calling a detached actor.

    RLFLOW_HOME=/tmp/somewhere python tests/stack/recipe.py     # starts the stack there when absent

1. ensure_stack + apply_connect_env: PREFECT_API_URL, RAY_ADDRESS and the Ray token for this process.
2. A detached actor `recipe/counter` in namespace "rlflow", created by a driver that then disconnects.
3. Flow run 1: three stage tasks (num_cpus=0 + one `rlflow_stage`), results persisted under a cache key
   (run_id, iteration, stage); the third fails once. The runner connects to Ray and disconnects at the end.
4. A retry of the same flow run: set to AwaitingRetry (forced: without a deployment the server refuses)
   and run again in-process: the two finished stages come back Cached (the actor is not called again),
   the third runs. Then a new flow run with the same keys: all three Cached.
5. The actor outlived every flow run. 6. Task overhead: cold (new driver) and warm (the process keeps
   its Ray connection, so the runner neither owns nor shuts down Ray).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import ray
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.flow_engine import run_flow
from prefect.states import AwaitingRetry
from prefect_ray.context import remote_options
from prefect_ray.task_runners import RayTaskRunner

from infra.stack import STAGE_RESOURCE, apply_connect_env, ensure_stack

RESULTS = Path(tempfile.mkdtemp(prefix="rlflow-recipe-"))  # in rlflow: <storage.root>/<run_id>/..., or s3
FAIL_ONCE = RESULTS / "fail_stage_c_once"
STAGE = {"num_cpus": 0, "resources": {STAGE_RESOURCE: 1}}


@ray.remote(num_cpus=0)
class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def bump(self) -> int:
        self.calls += 1
        return self.calls

    def pid(self) -> int:
        return os.getpid()


def stage_key(
    ctx, params
) -> str:  # the recovery contract's (run_id, iteration, stage); + config hash in rlflow
    return f"{params['run_id']}-{params['iteration']:06d}-{ctx.task.name}"


def make_stage(name: str):
    @task(name=name, cache_key_fn=stage_key, persist_result=True, result_storage=RESULTS)
    def run(run_id: str, iteration: int) -> dict:
        if name == "stage_c" and FAIL_ONCE.exists():
            FAIL_ONCE.unlink()
            raise RuntimeError("injected failure")
        actor = ray.get_actor(
            f"{run_id}/counter", namespace="rlflow"
        )  # by name: never a handle in the inputs
        return {"stage": name, "actor_calls": ray.get(actor.bump.remote())}

    return run


STAGES = [make_stage(name) for name in ("stage_a", "stage_b", "stage_c")]


def build_flows(address: str):
    runner = RayTaskRunner(address=address, init_kwargs={"namespace": "rlflow"})

    @flow(task_runner=runner)
    def iteration(run_id: str, iteration: int) -> list:
        with remote_options(**STAGE):
            return [st.submit(run_id, iteration).result() for st in STAGES]

    @task(cache_policy=None, persist_result=False)
    def noop(submitted: float) -> float:
        return time.time() - submitted

    @flow(task_runner=RayTaskRunner(address=address, init_kwargs={"namespace": "rlflow"}))
    def overhead(n: int) -> list[float]:
        with remote_options(**STAGE):
            return [round(noop.submit(time.time()).result(), 3) for _ in range(n)]

    return iteration, overhead


def task_states(client, flow_run_id) -> list[str]:
    from prefect.client.schemas.filters import FlowRunFilter

    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
    return sorted(f"{tr.name.rsplit('-', 1)[0]}:{tr.state.name}" for tr in runs)


def main() -> None:
    t = time.monotonic()
    info = ensure_stack()
    apply_connect_env(info)
    print(f"stack: {info} ({time.monotonic() - t:.1f} s)")
    iteration, overhead = build_flows(info.ray_address)

    ray.init(address=info.ray_address, namespace="rlflow", log_to_driver=False)
    actor = Counter.options(name="recipe/counter", lifetime="detached", get_if_exists=True).remote()
    actor_pid = ray.get(actor.pid.remote())
    ray.shutdown()

    FAIL_ONCE.touch()
    t = time.monotonic()
    first = iteration(run_id="recipe", iteration=1, return_state=True)
    print(f"flow run 1: {first.name} in {time.monotonic() - t:.1f} s")
    flow_run_id = first.state_details.flow_run_id

    with get_client(sync_client=True) as client:
        print("  tasks:", task_states(client, flow_run_id))
        # Without a deployment the server refuses to reschedule (ABORT: "Cannot reschedule a run without an
        # associated deployment"): the UI's Retry needs a deployment (serve/worker). In-process, force it.
        refused = client.set_flow_run_state(flow_run_id, AwaitingRetry())
        print(f"  AwaitingRetry without a deployment: {refused.status.value} ({refused.details.reason})")
        client.set_flow_run_state(flow_run_id, AwaitingRetry(), force=True)
        flow_run = client.read_flow_run(flow_run_id)
    print(f"set to {flow_run.state.name}; running the same flow run again")
    t = time.monotonic()
    result = run_flow(iteration, flow_run=flow_run, parameters=flow_run.parameters, return_type="state")
    print(f"flow run 1, retry: {result.name} in {time.monotonic() - t:.1f} s -> {result.result()}")
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        print(
            f"  {flow_run.state.name}, run_count {flow_run.run_count}, tasks:",
            task_states(client, flow_run_id),
        )

    t = time.monotonic()
    again = iteration(run_id="recipe", iteration=1, return_state=True)
    with get_client(sync_client=True) as client:
        states = task_states(client, again.state_details.flow_run_id)
    print(f"flow run 2 (same keys): {again.name} in {time.monotonic() - t:.1f} s, tasks: {states}")

    ray.init(address=info.ray_address, namespace="rlflow", log_to_driver=False)
    survivor = ray.get_actor("recipe/counter", namespace="rlflow")
    print(f"actor after 3 flow runs: pid {ray.get(survivor.pid.remote())} (created as {actor_pid}), "
          f"calls {ray.get(survivor.bump.remote()) - 1}")  # fmt: skip
    ray.kill(survivor)
    ray.shutdown()

    print("overhead, runner owns the connection (new driver per flow run):", overhead(n=5))
    ray.init(address=info.ray_address, namespace="rlflow", log_to_driver=False)
    for i in range(2):
        print(f"overhead, process holds the connection, flow {i}:", overhead(n=5))
    ray.shutdown()


if __name__ == "__main__":
    main()
