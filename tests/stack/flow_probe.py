"""Run by test_stack.py in a fresh process: a flow on a RayTaskRunner connected to the running stack.

    python flow_probe.py HOME  ->  one JSON line on stdout

Steps: create a detached actor in namespace "rlflow" (own driver, then disconnect); run a flow whose
task (num_cpus=0 + one `rlflow_stage`) calls the actor by name and reads flow runs from the API (which
needs the stack's auth string there, with no env var for it); the runner connects to the head and
disconnects at the end; then check the actor is still alive and read the flow run's state back from
the Prefect server. Prefect and Ray are imported before the stack's environment is applied, on
purpose: apply_connect_env must refresh both.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import ray
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect_ray.context import remote_options
from prefect_ray.task_runners import RayTaskRunner

from infra.config import StackConfig
from infra.stack import STAGE_RESOURCE, LocalStack, apply_connect_env

ACTOR = "probe/actor"


@ray.remote(num_cpus=0)
class Probe:
    def pid(self) -> int:
        return os.getpid()


@task(persist_result=False, cache_policy=None)
def stage() -> dict:
    from prefect.settings import get_current_settings

    actor = ray.get_actor(ACTOR, namespace="rlflow")
    auth = get_current_settings().api.auth_string
    with get_client(sync_client=True) as client:  # a POST: the auth string and a CSRF token
        runs = client.read_flow_runs(limit=1)
    return {
        "api_url": str(get_current_settings().api.url),
        "api_auth_sha256": hashlib.sha256(auth.get_secret_value().encode()).hexdigest() if auth else None,
        "worker_read_runs": len(runs),
        "env_has_auth": "PREFECT_API_AUTH_STRING" in os.environ,
        "resources": ray.get_runtime_context().get_assigned_resources(),
        "actor_pid": ray.get(actor.pid.remote()),
    }


def main(home: str) -> None:
    info = LocalStack(StackConfig(home=home)).status().info()
    apply_connect_env(info)

    ray.init(address=info.ray_address, namespace="rlflow", log_to_driver=False)
    actor = Probe.options(name=ACTOR, lifetime="detached", get_if_exists=True).remote()
    actor_pid = ray.get(actor.pid.remote())
    ray.shutdown()

    @flow(task_runner=RayTaskRunner(address=info.ray_address, init_kwargs={"namespace": "rlflow"}))
    def probe_flow() -> dict:
        with remote_options(num_cpus=0, resources={STAGE_RESOURCE: 1}):
            return stage.submit().result()

    state = probe_flow(return_state=True)
    result = state.result()

    ray.init(address=info.ray_address, namespace="rlflow", log_to_driver=False)
    survivor_pid = ray.get(ray.get_actor(ACTOR, namespace="rlflow").pid.remote())
    ray.kill(ray.get_actor(ACTOR, namespace="rlflow"))
    ray.shutdown()

    with get_client(sync_client=True) as client:
        server_state = client.read_flow_run(state.state_details.flow_run_id).state
    out = {
        **result,
        "flow_state": state.type.value,
        "server_state": server_state.type.value if server_state else None,
        "actor_pid_before": actor_pid,
        "actor_pid_after": survivor_pid,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
