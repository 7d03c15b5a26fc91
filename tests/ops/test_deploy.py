"""Recurring runs through the real CLI: `rlflow deploy` creates the deployment, `rlflow serve` runs it
against the session's stack. A lineage continued by two scheduled runs (the second waits for the first),
a new run from a base checkpoint whose overlapping twin is cancelled, and the lineage in run.json."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from tests.ops.conftest import (
    FLOW,
    NEVER,
    Server,
    api_settings,
    flow_logs,
    run_args,
    serving,
    subflow_runs,
    trigger,
    wait_for,
)
from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LINEAGE = "nightly"
# The lineage trains LoRA adapters (its checkpoints hold only them) and exports them merged too.
LORA = ("actor.lora.rank=4", "actor.lora.alpha=8", "trainer.export_merged=true")
INTERVAL_S = 20  # the first scheduled run comes due soon after the deployment


def deployment_runs(client: Any, name: str) -> list[Any]:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter

    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[name])),
                                 flow_run_filter=FlowRunFilter())
    return sorted(runs, key=lambda r: r.expected_start_time)


def test_deploy_refuses_bad_input(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Checked before anything starts (no stack in this RLFLOW_HOME) and before a deployment exists."""
    home = tmp_path / "home"

    def nothing(*args: str) -> subprocess.CompletedProcess[str]:
        return warm_cli(*args, env={"RLFLOW_HOME": str(home)})

    base = run_args(tiny_model_dir, tmp_path, "trainer.iterations_per_run=1")
    secret = "s3cr3t-never-in-parameters"
    cases = {
        (f"storage.secret_access_key={secret}", "--cron", NEVER): "AWS_SECRET_ACCESS_KEY",
        ("trainer.run_id=x", "--cron", NEVER, "--mode", "fresh"): "leave trainer.run_id unset",
        ("trainer.iterations_per_run=null", "--cron", NEVER): "trainer.iterations_per_run",
        ("--cron", NEVER, "--base-checkpoint", "missing:3"): "no committed checkpoint step 3 of run 'missing'",
        ("--cron", NEVER, "--name", "bad/name"): "run id 'bad/name'",
    }
    for extra, message in cases.items():
        proc = nothing("deploy", *base, *extra)
        assert proc.returncode == 2, (extra, proc.stderr[-2000:])
        assert message in proc.stderr and "Traceback" not in proc.stderr, (extra, proc.stderr[-2000:])
        assert secret not in proc.stdout + proc.stderr
    assert not (home / "stack").exists()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deployed-runs")


@pytest.fixture(scope="module")
def lineage(cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path, root: Path, api_url: str, stack_home: Path,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`nightly` (every 20 s, one iteration a run, ENQUEUE) continued by its first scheduled run and by
    a run asked for while that one runs."""
    from prefect import get_client
    from prefect.settings import temporary_settings

    start = time.monotonic()
    proc = warm_cli("deploy", *run_args(tiny_model_dir, root, "trainer.iterations_per_run=1", *LORA), "--name", LINEAGE,
               "--interval", str(INTERVAL_S))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"deployment {FLOW}/{LINEAGE}" in proc.stdout
    with temporary_settings(updates=api_settings(api_url, stack_home)), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"{FLOW}/{LINEAGE}")
        with serving(cli, [LINEAGE], tmp_path_factory.mktemp("serve-home")) as server:
            runs = _scheduled_then_queued(client, deployment.id, server)
        states = {r.id: [s.name for s in client.read_flow_run_states(r.id)] for r in runs}
        timeline = "\n".join(f"{r.name} due {r.expected_start_time:%H:%M:%S}: " + ", ".join(
            f"{s.name} {s.timestamp:%H:%M:%S}" for s in client.read_flow_run_states(r.id))
            for r in deployment_runs(client, LINEAGE))
        trains = {r.id: subflow_runs(client, r.id) for r in runs}
    return {"deployment": deployment, "runs": runs, "states": states, "trains": trains, "timeline": timeline,
            "seconds": time.monotonic() - start}


def _scheduled_then_queued(client: Any, deployment_id: Any, server: Server, timeout_s: float = 480) -> list[Any]:
    """The first scheduled run; once it runs, the schedule is paused and a second run is asked for, which
    must wait for the first (ENQUEUE). Both flow runs, finished."""
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout_s
    while not (started := [r for r in deployment_runs(client, LINEAGE) if r.start_time is not None]):
        assert time.monotonic() < deadline, f"no scheduled run started:\n{server.tail()}"
        time.sleep(1)
    client.pause_deployment(deployment_id)  # no third run
    for run in deployment_runs(client, LINEAGE):
        if run.start_time is None:
            with contextlib.suppress(ObjectNotFound):  # pausing removes the scheduled ones too
                client.delete_flow_run(run.id)
    queued = trigger(client, LINEAGE)
    runs = [wait_for(client, r.id, lambda s: s.is_final(), server, deadline - time.monotonic())
            for r in (started[0], queued)]
    failed = [r for r in runs if not r.state.is_completed()]
    if failed:
        ids = [failed[0].id, *(t.id for t in subflow_runs(client, failed[0].id))]
        raise AssertionError(f"{failed[0].name}: {failed[0].state.message}\n{flow_logs(client, ids)[-6000:]}\n"
                             f"{server.tail()}")
    return runs


@pytest.mark.effect_of("trainer.iterations_per_run")
def test_continue_lineage_on_schedule(lineage: dict[str, Any], root: Path, warm_cli: WarmCli, tiny_model_dir: Path) -> None:
    first, second = lineage["runs"]
    assert first.auto_scheduled and not second.auto_scheduled  # made by the schedule; by hand meanwhile
    # It came while the first ran: it waited, and they never overlapped.
    assert "AwaitingConcurrencySlot" in lineage["states"][second.id], lineage["timeline"]
    assert first.end_time <= second.start_time, lineage["timeline"]
    assert [t.parameters["resume"] for r in (first, second) for t in lineage["trains"][r.id]] == [None, LINEAGE]
    deployment = lineage["deployment"]
    assert deployment.global_concurrency_limit.limit == 1
    assert deployment.concurrency_options.collision_strategy.value == "ENQUEUE"
    assert set(deployment.parameters) == {"config_path", "overrides", "mode", "lineage", "base_checkpoint"}
    # One run, two iterations: each scheduled run did one more, from the latest checkpoint, on new prompts.
    run = root / LINEAGE
    assert sorted(p.name for p in (run / "metrics").iterdir()) == ["iter_000001.json", "iter_000002.json"]
    assert (run / "checkpoints" / "step_000002" / "MANIFEST.json").exists()
    rows = [set(pq.read_table(run / "buffers" / f"iter_{i:06d}" / "rollout.parquet", columns=["row_index"],
                              use_threads=False).column("row_index").to_pylist()) for i in (1, 2)]
    assert rows[0] and rows[1] and not rows[0] & rows[1]
    info = json.loads((run / "run.json").read_text())
    assert info["parent"] is None and info["code_version"] and info["config_hash"]
    assert info["base_model"]["path"] == str(tiny_model_dir) and len(info["base_model"]["sha256"]) == 64
    # A LoRA lineage: one base model and a history of adapter checkpoints, each run going on from the last.
    import torch.distributed.checkpoint as dcp

    for step in (1, 2):
        keys = dcp.FileSystemReader(str(run / "checkpoints" / f"step_{step:06d}" / "policy")).read_metadata()
        weights = [k for k in keys.state_dict_metadata if k.startswith("model.")]
        assert weights and all("lora_" in k for k in weights), weights[:3]
    adapters = [load_file(run / "export" / f"step_{i:06d}" / "adapter_model.safetensors") for i in (1, 2)]
    assert adapters[0].keys() == adapters[1].keys()
    assert any(not bool((adapters[0][k] == adapters[1][k]).all()) for k in adapters[0])
    shown = warm_cli("runs", "show", LINEAGE, "--root", str(root))
    assert shown.returncode == 0 and "code version" in shown.stdout and info["config_hash"][:12] in shown.stdout


def test_fresh_run_from_base_checkpoint(lineage: dict[str, Any], cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path,
                                        root: Path, prefect: Any, tmp_path: Path) -> None:
    """Mode fresh with CANCEL_NEW: two runs due at once, one starts a new run from `nightly` step 2 and the
    other is cancelled."""
    name = "branch"
    base = str(root / LINEAGE / "checkpoints" / "step_000002")  # the URL form; `nightly:2` is the same
    proc = warm_cli("deploy", *run_args(tiny_model_dir, root, "trainer.total_iterations=1"), "--name", name,
               "--mode", "fresh", "--base-checkpoint", base, "--collision", "cancel-new", "--cron", NEVER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with serving(cli, [name], tmp_path / "serve-home") as server:
        ids = [trigger(prefect, name).id, trigger(prefect, name).id]
        runs = [wait_for(prefect, i, lambda s: s.is_final(), server) for i in ids]
    assert sorted(r.state.name for r in runs) == ["Cancelled", "Completed"], [r.state.message for r in runs]
    done = next(r for r in runs if r.state.is_completed())
    child = subflow_runs(prefect, done.id)[0].parameters["run_name"]
    assert child.startswith(f"{name}-") and child.endswith(done.id.hex[:8])
    info = json.loads((root / child / "run.json").read_text())
    assert info["parent"]["run_id"] == LINEAGE and info["parent"]["step"] == 2
    assert info["parent"]["checkpoint"].endswith("nightly/checkpoints/step_000002")
    assert info["config"]["model"]["path"] == info["parent"]["model_path"]
    # The new run's model is the parent's policy at step 2, exactly: its base with the step's adapters
    # merged, as the parent's merged export of that step.
    made = load_file(Path(info["parent"]["model_path"]) / "model.safetensors")
    exported = load_file(root / LINEAGE / "export" / "step_000002_merged" / "model.safetensors")
    assert made.keys() == exported.keys() and all(bool((made[k] == exported[k]).all()) for k in made)
    assert (root / child / "metrics" / "iter_000001.json").exists()
    shown = warm_cli("runs", "show", child, "--root", str(root))
    assert shown.returncode == 0 and f"{LINEAGE} step 2" in shown.stdout, shown.stdout

