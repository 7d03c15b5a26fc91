"""Faults mid-run, each through the real CLI, stack and storage. Every test asserts: the run completes;
the final weights equal an uninterrupted run's bit for bit (CPU); no complete buffer was regenerated;
no prompt was skipped or used twice (the rollout buffers' `row_index`, the sampler's record)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REWARD = f"reward.function={Path(__file__).resolve().parents[1] / 'pipeline' / 'rewards.py'}:digit_share"
ITERATIONS = 3


def args(model: Path, root: str, run_id: str, *extra: str) -> list[str]:
    return [f"model.path={model}", f"storage.root={root}", f"trainer.run_id={run_id}", REWARD,
            f"trainer.total_iterations={ITERATIONS}", "trainer.save_every=1", "trainer.val_every=0",
            "data.train_batch_size=8", "actor.mini_batch_size=32", "actor.micro_batch_size=32", "data.train_size=256", "data.val_size=16", "rollout.max_new_tokens=8", *extra]


def weights(root: Path, run_id: str) -> dict:
    return load_file(root / run_id / "export" / f"step_{ITERATIONS:06d}" / "model.safetensors")


def sampler_record(root: Path, run_id: str) -> list[list[int]]:
    """The prompt rows of every iteration, from its rollout buffer."""
    out = []
    for i in range(1, ITERATIONS + 1):
        table = pq.read_table(root / run_id / "buffers" / f"iter_{i:06d}" / "rollout.parquet",
                              columns=["row_index"], use_threads=False)
        out.append(sorted(set(table.column("row_index").to_pylist())))
    return out


def buffers(root: Path, run_id: str) -> dict[str, tuple[int, bytes]]:
    found = {}
    for path in sorted((root / run_id / "buffers").rglob("*.parquet")):
        found[str(path.relative_to(root))] = (path.stat().st_mtime_ns, path.read_bytes())
    return found


def written_once(times: dict[tuple[int, str], float]) -> None:
    """Every buffer was written before every later stage's buffer: one regenerated after a failure
    (an earlier stage redone after a later one, or an iteration redone after the next began) breaks it.
    `times`: (iteration, buffer name) -> modification time."""
    order = []
    for i in range(1, ITERATIONS + 1):
        order += [((i, "rollout"),), ((i, "reward"), (i, "old_logprob")), ((i, "advantage"),)]
    for earlier, later in zip(order, order[1:]):
        assert max(times[k] for k in earlier) <= min(times[k] for k in later), (earlier, later)


def local_times(root: Path, run_id: str) -> dict[tuple[int, str], float]:
    return {(i, name): (root / run_id / "buffers" / f"iter_{i:06d}" / f"{name}.parquet").stat().st_mtime
            for i in range(1, ITERATIONS + 1) for name in ("rollout", "reward", "old_logprob", "advantage")}


def assert_like_uninterrupted(root: Path, run_id: str, reference: dict, times: dict | None = None) -> None:
    got = weights(root, run_id)
    assert got.keys() == reference["weights"].keys()
    for key in got:
        assert bool((got[key] == reference["weights"][key]).all()), key
    record = sampler_record(root, run_id)
    assert record == reference["record"]  # the same prompts, none skipped, none twice
    flat = [r for rows in record for r in rows]
    assert len(flat) == len(set(flat))
    written_once(times if times is not None else local_times(root, run_id))


def assert_reused(root: Path, run_id: str, iteration: int) -> None:
    line = json.loads((root / run_id / "metrics" / f"iter_{iteration:06d}.json").read_text())
    assert line["stages/reused"] >= 4, line["stages/reused"]  # rollout, reward, old_logprob, advantage


@pytest.fixture(scope="module", autouse=True)
def zombie(cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> float:
    """A run whose flow process is SIGKILLed and that nothing resumes, started before the module's other
    tests so that its heartbeat window (flows/liveness.WINDOW_S, 180 s) passes while they run (its check
    comes after the LoRA kill test, so that the window has passed by then instead of being waited for,
    and before the test that restarts the Prefect server: a restart within the window loses the pending
    trigger, seen in a fresh-clone run of f4179df where the restart came 30 s after the window); its engine
    is stopped at once (it would hold the cluster's CPUs; the flow run's state is the claim, so one rank:
    the second only cost its start). Returns when the process died (time.monotonic)."""
    proc = cli("train", *args(tiny_model_dir, str(tmp_path_factory.mktemp("zombie")), "zombie", "trainer.world_size=1",
                              "debug.kill_flow_after=generate_rollouts", "debug.kill_iteration=2"))
    died = time.monotonic()
    stopped = warm_cli("engine", "stop", "zombie")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    return died


@pytest.mark.effect_of("debug.kill_iteration", "debug.kill_rank_mid_update", "debug.kill_during_checkpoint")
def test_engine_rank_killed_mid_update_then_killed_during_checkpoint_upload(
        warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path, reference: dict) -> None:
    """One run carries both faults of iteration 2: rank 1 dies mid-update (the engine restarts, restores
    checkpoint step 1 and replays), then the process saving step 2 dies after the shards are written and
    before the commit (the save is retried; step 2 is committed once)."""
    start = time.monotonic()
    proc = warm_cli("train", *args(tiny_model_dir, str(tmp_path), "rank-kill", "debug.kill_rank_mid_update=1",
                                   "debug.kill_during_checkpoint=true", "debug.kill_iteration=2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    logs = proc.stdout + proc.stderr
    assert "iteration 2: the engine failed" in logs and "restored checkpoint step 1" in logs
    assert_reused(tmp_path, "rank-kill", 2)
    assert (tmp_path / "rank-kill" / "debug" / "killed_checkpoint_000002").exists()  # the kill happened
    ckpts = tmp_path / "rank-kill" / "checkpoints"
    assert (ckpts / "LATEST").read_text().strip().endswith("3")
    assert (ckpts / "step_000002" / "MANIFEST.json").exists()
    assert_like_uninterrupted(tmp_path, "rank-kill", reference)
    print(f"rank kill + checkpoint-upload kill: {time.monotonic() - start:.0f} s")


@pytest.mark.effect_of("trainer.stage_timeouts", "debug.stop_rank_mid_update")
def test_hung_rank_mid_update_is_restarted(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path,
                                           reference: dict) -> None:
    """Rank 1 stops itself (SIGSTOP) after its first backward of iteration 2: alive, but hung, and rank
    0 blocks in the gradient collective. After the update stage's timeout (trainer.stage_timeouts, here
    10 s: a healthy update of this run takes ~1 s; 20 s until 2026-12-07, all of it waiting; the other
    stages keep the default) the engine is declared hung, stopped, restarted, restored and replayed; the
    iteration runs again reusing its finished stages."""
    start = time.monotonic()
    proc = warm_cli("train", *args(tiny_model_dir, str(tmp_path), "hung", "debug.stop_rank_mid_update=1",
                              "debug.kill_iteration=2", "trainer.stage_timeouts={update_policy: 10}"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    logs = proc.stdout + proc.stderr
    assert ("iteration 2: the engine failed (rank(s) [0, 1] made no progress in update_actor for 10 s "
            "(trainer.stage_timeouts.update_policy): declared hung); restart 1 of 2") in logs, logs[-3000:]
    line = json.loads((tmp_path / "hung" / "metrics" / "iter_000002.json").read_text())
    assert line["engine/restarts"] == 1 and line["engine/hung_restarts"] == 1 and line["engine/restart_s"] > 0
    assert "engine/restarts" not in json.loads((tmp_path / "hung" / "metrics" / "iter_000003.json").read_text())
    assert_reused(tmp_path, "hung", 2)
    assert_like_uninterrupted(tmp_path, "hung", reference)
    print(f"hung rank: {time.monotonic() - start:.0f} s")


def test_flow_process_killed_then_resumed_from_storage_past_a_corrupted_shard(
        cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path, reference: dict, prefect: Any) -> None:
    """The flow process is killed after iteration 3's rollouts, its engine stopped and a shard of the last
    committed checkpoint (step 2) corrupted: another process resumes from storage alone, warns naming the
    bad file, restores step 1 and replays iteration 2's updates from its buffers, and ends like the
    uninterrupted run with every complete buffer kept (none rewritten), Prefect's result records of the run
    deleted first: iteration 3's finished rollout is reused from storage by the stage itself
    (tasks/stages._reuse; with it returning None the rollout is regenerated and this test fails on its
    rewritten buffer, seen on this tree). The killed process's flow run and
    its iteration subflow, left "Running" in the UI, are marked Crashed by the resumed run, naming it.
    (One run since this round, two before: a killed flow resumed on its still-live engine is
    tests/pipeline/test_reward_model.py's rm-kill, attached to the live engine.)"""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import get_current_settings

    from tests.ops.conftest import subflow_runs

    start = time.monotonic()
    first = cli("train", *args(tiny_model_dir, str(tmp_path), "corrupt", "debug.kill_flow_after=generate_rollouts",
                               "debug.kill_iteration=3"))
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert warm_cli("engine", "stop", "corrupt").returncode == 0  # so the resume has to restore from storage
    before = buffers(tmp_path, "corrupt")
    shard = sorted((tmp_path / "corrupt" / "checkpoints" / "step_000002" / "policy").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # Prefect's result records of the run gone too (another machine, a cleared PREFECT_HOME): iteration 3's
    # finished rollout then comes back through the stage's own reuse of its stored buffer (tasks/stages._reuse),
    # not as Prefect's Cached; the buffers' unchanged mtimes below show that its body did not run.
    results = Path(get_current_settings().results.local_storage_path)
    records = list(results.glob("corrupt-*"))
    assert any("-3-generate_rollouts-" in p.name for p in records), sorted(p.name for p in records)[:20]
    for record in records:
        record.unlink()
    resumed = warm_cli("train", "--resume", "corrupt", f"storage.root={tmp_path}", REWARD)  # not the killed process
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    logs = resumed.stdout + resumed.stderr
    assert shard.name in logs  # the warning names the bad file
    assert "restored checkpoint step 1" in logs and "replaying the updates of iteration 2" in logs
    after = buffers(tmp_path, "corrupt")
    assert all(after[k] == v for k, v in before.items())  # every complete buffer kept, none rewritten
    assert_like_uninterrupted(tmp_path, "corrupt", reference)
    killed, resumed_run = sorted(prefect.read_flow_runs(flow_run_filter=FlowRunFilter(
        name=FlowRunFilterName(any_=["corrupt"]))), key=lambda r: r.created)
    assert resumed_run.state.is_completed()
    for run in (killed, *subflow_runs(prefect, killed.id)):
        assert run.state.is_final(), (run.name, run.state)
    assert killed.state.name == "Crashed" and f"resumed by flow run corrupt ({resumed_run.id})" in killed.state.message
    assert subflow_runs(prefect, killed.id)[-1].state.name == "Crashed"  # iteration 3, killed mid-way
    print(f"flow kill + corrupted shard + resume: {time.monotonic() - start:.0f} s")


LORA = ("actor.lora.rank=4", "actor.lora.alpha=8", "actor.lr=1e-3")


def adapters(root: Path, run_id: str) -> dict:
    return load_file(root / run_id / "export" / f"step_{ITERATIONS:06d}" / "adapter_model.safetensors")


def test_lora_rank_killed_then_flow_killed_and_resumed_on_a_new_engine(cli: Cli, warm_cli: WarmCli,
                                                                      tiny_model_dir: Path, tmp_path: Path) -> None:
    """LoRA: a rank dies mid-update of iteration 2 (the engine restarts, restores the adapter-only
    checkpoint of step 1 and replays), then the flow process is killed after that update, and the engine
    with it (a lost machine); `--resume` starts a new engine, restores step 1's adapters again and
    replays. The adapters end bit-identical to an uninterrupted LoRA run's, on the same prompts."""
    ref_root = tmp_path / "reference"
    proc = warm_cli("train", *args(tiny_model_dir, str(ref_root), "lora-reference", *LORA))
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = {"weights": adapters(ref_root, "lora-reference"), "record": sampler_record(ref_root, "lora-reference")}
    first = cli("train", *args(tiny_model_dir, str(tmp_path), "lora-kill", *LORA, "debug.kill_rank_mid_update=1",
                               "debug.kill_flow_after=update_policy", "debug.kill_iteration=2"))
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    logs = first.stdout + first.stderr
    assert "iteration 2: the engine failed" in logs and "restored checkpoint step 1" in logs, logs[-3000:]
    stopped = warm_cli("engine", "stop", "lora-kill")
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    resumed = warm_cli("train", "--resume", "lora-kill", f"storage.root={tmp_path}", REWARD)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "restored checkpoint step 1" in resumed.stdout + resumed.stderr
    got = adapters(tmp_path, "lora-kill")
    assert got.keys() == reference["weights"].keys() and all("lora_" in k for k in got)
    for key in got:
        assert bool((got[key] == reference["weights"][key]).all()), key
    assert sampler_record(tmp_path, "lora-kill") == reference["record"]
    manifest = json.loads((tmp_path / "lora-kill" / "checkpoints" / "step_000003" / "MANIFEST.json").read_text())
    print(f"LoRA checkpoint: {sum(f['size'] for f in manifest['files'])} bytes")


def test_a_killed_controller_is_marked_crashed_by_its_missing_heartbeat(zombie: float, prefect: Any, api_url: str,
                                                                       stack_home: Path) -> None:
    """The flow process is SIGKILLed and nothing resumes it (the `zombie` fixture, started first; this check
    runs after the tests above, the window passing during them, and before the Prefect server's restart
    below): Prefect's automation (flows/liveness.py) sets its flow run Crashed once its heartbeat has been
    missing for WINDOW_S."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from flows.liveness import AUTOMATION, WINDOW_S

    assert prefect.read_automations_by_name(AUTOMATION)
    deadline = zombie + WINDOW_S + 90
    while True:
        (run,) = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["zombie"])))
        if run.state.is_final() or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert run.state.name == "Crashed" and f"no heartbeat for {WINDOW_S} s" in run.state.message, run.state
    # The automation an earlier version made (a 90 s window) is brought to WINDOW_S by the next run's start.
    from datetime import timedelta

    from prefect.events.schemas.automations import AutomationCore
    from prefect.settings import temporary_settings

    from flows.liveness import ensure_crash_automation
    from tests.ops.conftest import api_settings

    [automation] = prefect.read_automations_by_name(AUTOMATION)
    assert automation.trigger.within == timedelta(seconds=WINDOW_S)
    older = automation.model_dump(exclude={"id", "owner_resource"})  # what an update may carry
    older["trigger"]["within"] = timedelta(seconds=90)
    prefect.update_automation(automation.id, AutomationCore.model_validate(older))
    assert prefect.read_automations_by_name(AUTOMATION)[0].trigger.within == timedelta(seconds=90)
    with temporary_settings(updates=api_settings(api_url, stack_home)):
        ensure_crash_automation()
    [updated] = prefect.read_automations_by_name(AUTOMATION)
    assert updated.id == automation.id and updated.trigger.within == timedelta(seconds=WINDOW_S)


def test_s3_down_for_10s_then_prefect_server_restarted_mid_run(cli: Cli, tiny_model_dir: Path, s3_server,
                                                              stack_home: Path, reference: dict,
                                                              tmp_path: Path) -> None:
    """One run on S3 carries both outages: after iteration 1 the S3 endpoint refuses connections for 10 s;
    after iteration 2 the Prefect server goes away and comes back on its port."""
    from infra.config import StackConfig
    from infra.stack import LocalStack
    from tests.infra.storage_helpers import ProxyProcess  # a TCP proxy in front of the S3 server

    start = time.monotonic()
    proxy = ProxyProcess(s3_server.port)
    proxy.start()
    fs = _s3(s3_server)
    prefix = f"{s3_server.bucket}/faults-{tmp_path.name}"

    def wait_for_metrics(iteration: int) -> None:
        deadline = time.monotonic() + 300
        while not fs.exists(f"{prefix}/outages/metrics/iter_{iteration:06d}.json") and time.monotonic() < deadline \
                and run.poll() is None:
            time.sleep(0.5)
        fs.invalidate_cache()

    try:
        env = {**s3_server.env, "AWS_ENDPOINT_URL": proxy.endpoint_url}
        run = cli.popen("train", *args(tiny_model_dir, f"s3://{prefix}", "outages"), env=env)
        wait_for_metrics(1)
        proxy.kill()  # connections refused for 10 s, mid-run
        time.sleep(10)
        proxy.start()  # back on the same port
        wait_for_metrics(2)
        record = LocalStack(StackConfig(home=str(stack_home))).status().prefect.record
        assert record is not None
        os.kill(record.pid, signal.SIGTERM)  # the Prefect server goes away mid-run...
        gone = time.monotonic() + 60
        while Path(f"/proc/{record.pid}").exists() and time.monotonic() < gone:
            time.sleep(0.2)
        down_s = time.monotonic()
        LocalStack(StackConfig(home=str(stack_home), prefect_port=record.port)).up(("prefect",))  # ...and comes back
        print(f"Prefect API was down {time.monotonic() - down_s:.0f} s")
        out, _ = run.communicate(timeout=600)
        if run.returncode != 0:
            cli("engine", "stop", "outages")  # a failed run keeps its engine: free its cores for others
        assert run.returncode == 0, out[-4000:]
    finally:
        proxy.kill()
    local = tmp_path / "copy"
    fs.get(f"{prefix}/outages", str(local / "outages"), recursive=True)
    times = {(i, name): fs.info(f"{prefix}/outages/buffers/iter_{i:06d}/{name}.parquet")["LastModified"].timestamp()
             for i in range(1, ITERATIONS + 1) for name in ("rollout", "reward", "old_logprob", "advantage")}
    assert_like_uninterrupted(local, "outages", reference, times)
    print(f"S3 down 10 s, then Prefect restarted: {time.monotonic() - start:.0f} s")


def _s3(server):  # noqa: ANN001, ANN202
    import s3fs

    return s3fs.S3FileSystem(key=server.env["AWS_ACCESS_KEY_ID"], secret=server.env["AWS_SECRET_ACCESS_KEY"],
                             endpoint_url=server.endpoint_url)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", __file__, "-q", "-s"]))
