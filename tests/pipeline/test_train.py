"""End to end: `rlflow train` in a subprocess against a real Prefect server, a real Ray head and the
local S3 server; a killed flow process resumes without regenerating, to the same weights bit for bit."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.services import Cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REWARD = f"reward.function={Path(__file__).with_name('rewards.py')}:digit_share"


def common(model: Path, root: str, run_id: str, *extra: str) -> list[str]:
    return [f"model.path={model}", f"storage.root={root}", f"trainer.run_id={run_id}", REWARD,
            "trainer.total_iterations=3", "trainer.save_every=2", "trainer.val_every=3", "data.train_size=256",
            "data.val_size=16", "rollout.max_new_tokens=8", *extra]


def exported_weights(root: Path, run_id: str, step: int) -> dict:
    return load_file(root / run_id / "export" / f"step_{step:06d}" / "model.safetensors")


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and bool((a[key] == b[key]).all()), key


def test_grpo_three_iterations_on_s3(cli: Cli, tiny_model_dir: Path, s3_server) -> None:
    env = {**cli.env, **s3_server.env}
    root = f"s3://{s3_server.bucket}/pipeline"
    proc = Cli(env)("train", *common(tiny_model_dir, root, "grpo-s3"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Prefect UI http://127.0.0.1:" in proc.stdout
    import s3fs

    fs = s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                           endpoint_url=s3_server.endpoint_url)
    base = f"{s3_server.bucket}/pipeline/grpo-s3"
    metrics = [json.loads(fs.cat(f"{base}/metrics/iter_{i:06d}.json")) for i in (1, 2, 3)]
    assert all("critic/score/mean" in m and "actor/pg_loss" in m for m in metrics)
    assert "val/score/mean" in metrics[2]
    assert fs.cat(f"{base}/checkpoints/LATEST").decode().strip().endswith("3")
    assert fs.exists(f"{base}/checkpoints/step_000002/MANIFEST.json")
    assert fs.exists(f"{base}/export/step_000003/model.safetensors")
    for name in ("rollout", "reward", "logprob", "advantage"):
        assert fs.exists(f"{base}/buffers/iter_000003/{name}.parquet")
    listed = cli("engine", "list")
    assert "grpo-s3" not in listed.stdout  # the engine is stopped at the end of the run


def test_ppo_two_iterations(cli: Cli, tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = cli("train", "configs/tiny_ppo.yaml",
               *common(tiny_model_dir, str(tmp_path), "ppo", "trainer.total_iterations=2", "trainer.val_every=0"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = json.loads((tmp_path / "ppo" / "metrics" / "iter_000002.json").read_text())
    assert {"critic/vf_loss", "critic/values/mean", "actor/pg_loss", "timing_s/update_critic"} <= set(last)


@pytest.fixture(scope="module")
def uninterrupted(cli: Cli, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("runs")
    proc = cli("train", *common(tiny_model_dir, str(root), "straight"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exported_weights(root, "straight", 3)


@pytest.mark.parametrize("kill_engine", [False, True], ids=["engine-alive", "engine-killed"])
def test_killed_flow_resumes_without_regenerating(kill_engine: bool, cli: Cli, tiny_model_dir: Path,
                                                  tmp_path: Path, uninterrupted: dict) -> None:
    run_id = "killed-engine" if kill_engine else "killed-flow"
    args = common(tiny_model_dir, str(tmp_path), run_id, "debug.kill_flow_after=generate_rollouts",
                  "debug.kill_iteration=2")
    first = cli("train", *args)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    rollout = tmp_path / run_id / "buffers" / "iter_000002" / "rollout.parquet"
    before = (rollout.read_bytes(), rollout.stat().st_mtime_ns)
    assert not (tmp_path / run_id / "metrics" / "iter_000002.json").exists()
    if kill_engine:
        stopped = cli("engine", "stop", run_id)
        assert stopped.returncode == 0 and "policy" in stopped.stdout, stopped.stderr
    resumed = cli("train", "--resume", run_id, f"storage.root={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert (rollout.read_bytes(), rollout.stat().st_mtime_ns) == before  # reused, not regenerated
    logs = resumed.stdout + resumed.stderr
    assert "iteration 2: reused generate_rollouts" in logs
    resumed_iter = json.loads((tmp_path / run_id / "metrics" / "iter_000002.json").read_text())
    assert resumed_iter["stages/reused"] >= 1
    if kill_engine:
        assert "replaying the updates of iteration 1" in logs
    else:
        assert "attached to the live engine" in logs
    assert_same_weights(exported_weights(tmp_path, run_id, 3), uninterrupted)
