"""End to end: `rlflow train` in a subprocess against a real Prefect server, a real Ray head and the
local S3 server: GRPO on S3 and PPO on a local folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REWARD = f"reward.function={Path(__file__).with_name('rewards.py')}:digit_share"


def common(model: Path, root: str, run_id: str, *extra: str) -> list[str]:
    return [f"model.path={model}", f"storage.root={root}", f"trainer.run_id={run_id}", REWARD,
            "trainer.total_iterations=3", "trainer.save_every=2", "trainer.val_every=3", "data.train_size=256",
            "data.train_batch_size=8", "actor.mini_batch_size=32", "actor.micro_batch_size=32", "data.val_size=16", "rollout.max_new_tokens=8", *extra]


@pytest.mark.effect_of("trainer.save_every", "trainer.val_every", "storage.root")
def test_grpo_three_iterations_on_s3(cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path, s3_server,
                                     stack_home: Path) -> None:
    env = {**cli.env, **s3_server.env}
    root = f"s3://{s3_server.bucket}/pipeline"
    # Chunks of 16 rows: the reward stage scores in parallel Ray tasks (the other tests score in-process).
    proc = Cli(env)("train", *common(tiny_model_dir, root, "grpo-s3", "reward.chunk_size=16"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Prefect UI http://127.0.0.1:" in proc.stdout
    assert f"(its password: the content of {stack_home / 'stack' / 'prefect_auth'})" in proc.stdout  # the UI's login
    # The console: one line per iteration (the progress display's); Prefect's lines about each iteration's
    # flow run ("Beginning subflow run", "View at", "Finished in state") and its log line are in the UI.
    console = (proc.stdout + proc.stderr).splitlines()
    assert [line.split()[1] for line in console if line.startswith("iter ")] == ["1", "2", "3"], console
    assert not [line for line in console if "Beginning subflow run" in line or "iter-0000" in line
                or "iter 1: reward" in line], console
    import s3fs

    fs = s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                           endpoint_url=s3_server.endpoint_url)
    base = f"{s3_server.bucket}/pipeline/grpo-s3"
    import hashlib

    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load, load_file

    metrics = [json.loads(fs.cat(f"{base}/metrics/iter_{i:06d}.json")) for i in (1, 2, 3)]
    for i, m in enumerate(metrics, start=1):
        # each iteration's numbers are its buffers' on S3: the mean score, and GRPO's group-normalized advantage
        with fs.open(f"{base}/buffers/iter_{i:06d}/reward.parquet", "rb") as f:
            score = torch.tensor(pq.read_table(f, columns=["score"]).column("score").to_pylist())
        assert m["critic/score/mean"] == pytest.approx(float(score.mean()), abs=1e-6), i
        with fs.open(f"{base}/buffers/iter_{i:06d}/advantage.parquet", "rb") as f:
            adv = pq.read_table(f, columns=["adv"]).column("adv").to_pylist()
        groups = score.view(-1, 8)
        want = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).flatten()
        assert torch.allclose(torch.tensor([row[0] for row in adv]), want, atol=1e-5), i
    assert "val/score/mean" in metrics[2] and "val/score/mean" not in metrics[1]
    assert fs.cat(f"{base}/checkpoints/LATEST").decode().strip().endswith("3")
    # trainer.save_every=2: steps 2 and 3 (the last) saved, iteration 1 none (keep_last 3 would have kept it)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{base}/checkpoints") if "/step_" in p) == \
        ["step_000002", "step_000003"]
    # the committed step's manifest is true of the objects: every file's size and sha256
    manifest = json.loads(fs.cat(f"{base}/checkpoints/step_000002/MANIFEST.json"))
    assert manifest["files"]
    for entry in manifest["files"]:
        data = fs.cat(f"{base}/checkpoints/step_000002/{entry['path']}")
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["size"], entry["sha256"]), entry["path"]
    exported, base_weights = load(fs.cat(f"{base}/export/step_000003/model.safetensors")), \
        load_file(tiny_model_dir / "model.safetensors")
    assert exported.keys() == base_weights.keys()
    assert any(not torch.equal(exported[k], base_weights[k]) for k in exported)  # trained
    listed = warm_cli("engine", "list")
    assert "grpo-s3" not in listed.stdout  # the engine is stopped at the end of the run


def test_ppo_with_lora_actor_and_critic_two_iterations(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path) -> None:
    """PPO (full fine-tuning PPO runs in tests/pipeline/test_algorithms.py) with LoRA on both models: the
    critic's checkpoint holds its adapters and its value head, the actor's its adapters."""
    import torch.distributed.checkpoint as dcp

    proc = warm_cli("train", "configs/tiny_ppo.yaml",
               *common(tiny_model_dir, str(tmp_path), "ppo", "trainer.total_iterations=2", "trainer.val_every=0",
                       "actor.lora.rank=4", "critic.lora.rank=4"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = json.loads((tmp_path / "ppo" / "metrics" / "iter_000002.json").read_text())
    assert {"critic/vf_loss", "critic/values/mean", "actor/pg_loss", "timing_s/update_critic"} <= set(last)
    step = tmp_path / "ppo" / "checkpoints" / "step_000002"
    for role, trained in (("policy", ("lora_",)), ("critic", ("lora_", "modules_to_save"))):
        keys = dcp.FileSystemReader(str(step / role)).read_metadata().state_dict_metadata
        weights = [k for k in keys if k.startswith("model.")]
        assert weights and all(any(t in k for t in trained) for k in weights), (role, weights[:3])
    assert any("modules_to_save" in k for k in keys)  # the critic's value head
    from safetensors.torch import load_file

    from engine.batch import Batch

    # the adapters trained: every lora_B starts at zero (peft's init) and is not zero after two updates
    adapters = load_file(tmp_path / "ppo" / "export" / "step_000002" / "adapter_model.safetensors")
    lora_b = [k for k in adapters if "lora_B" in k]
    assert lora_b and all(bool(adapters[k].abs().max() > 0) for k in lora_b), lora_b
    # the critic's values are the LoRA critic's: the reported mean is the values buffer's, over the response
    buffers = tmp_path / "ppo" / "buffers" / "iter_000002"
    values = Batch.from_parquet(str(buffers / "values.parquet"))["values"]
    mask = Batch.from_parquet(str(buffers / "rollout.parquet"))["response_mask"].bool()
    assert last["critic/values/mean"] == pytest.approx(float(values[mask].mean()), abs=1e-5)


def test_grpo_one_optimizer_step_skips_the_old_logprob_pass(warm_cli: WarmCli, tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    """8 prompts x 8 = 64 completions, mini-batch 64: no compute_old_logprobs stage, no old_logprob buffer."""
    proc = warm_cli("train", *common(tiny_model_dir, str(tmp_path), "onpolicy", "actor.mini_batch_size=64",
                                "trainer.total_iterations=2", "trainer.val_every=0"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "onpolicy"
    metrics = [json.loads((run / "metrics" / f"iter_{i:06d}.json").read_text()) for i in (1, 2)]
    for m in metrics:
        # (ppo_kl and pg_clipfrac are 0 here by construction: the update equals one with the pass, bit for
        # bit, in tests/engine/test_engine.py::test_update_without_old_logp_equals_update_with_recomputed_old_logp)
        assert "timing_s/old_log_prob" not in m
        assert m["actor/grad_norm"] > 0 and "timing_s/update_actor" in m
    assert (run / "buffers" / "iter_000002" / "advantage.parquet").exists()
    assert not (run / "buffers" / "iter_000002" / "old_logprob.parquet").exists()


# A flow process killed mid-iteration and resumed (engine alive: attach; engine killed: restore and
# replay) is tested against an uninterrupted run in tests/ops/test_faults.py.


def test_ctrl_c_stops_after_committing_the_current_iteration(cli: Cli, tiny_model_dir: Path, tmp_path: Path) -> None:
    import signal
    import time

    run = cli.popen("train", *common(tiny_model_dir, str(tmp_path), "interrupted", "trainer.total_iterations=50",
                                     "trainer.save_every=100", "trainer.val_every=0"))
    first = tmp_path / "interrupted" / "metrics" / "iter_000001.json"
    deadline = time.monotonic() + 300
    while not first.exists() and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
    run.send_signal(signal.SIGINT)  # one Ctrl-C: finish and commit the iteration in flight, then stop
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 0, out[-4000:]
    assert "stopping after this iteration is committed" in out
    done = sorted(p.name for p in (tmp_path / "interrupted" / "metrics").glob("iter_*.json"))
    last = int(done[-1][5:11])
    assert 1 <= last < 50
    latest = (tmp_path / "interrupted" / "checkpoints" / "LATEST").read_text().strip()
    assert latest.endswith(str(last))  # what finished is committed, so a resume goes on from there


def test_a_run_gives_the_same_bytes_under_another_machine_state(
    cli: Cli, warm_cli: WarmCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28 item 9: a run's result must not depend on the state of the machine. One short GRPO run of
    the default model (the tiny sort model, built on first use) twice:
    - on a stack whose Ray node (so every stage worker and rank) and CLI process start with torch's
      generic kernels, MKL's compatible path, oneDNN at SSE4.1 (what another CPU changes) and one OpenMP
      thread, a busy loop at the lowest priority, and an empty model cache: the tiny model is built here;
    - on the session's stack, unloaded, the model from that cache.
    The exported weights are the same bytes and the iteration's reward and loss the same numbers: the run
    pins the kernels of its workers and of the build (placement.cpu_kernels=auto), and the build's report
    says so. Not varied: the ranks' torch threads, which placement.cpus_per_rank sets (default: the
    cores / the ranks; another count sums in another order)."""
    import hashlib
    import subprocess
    import sys

    from infra.config import StackConfig
    from infra.stack import LocalStack
    from tests.services import quiet_port

    cache = tmp_path / "cache"

    def run(runner: Cli | WarmCli, run_id: str, env: dict[str, str]) -> tuple[str, float, float]:
        proc = runner("train", f"storage.root={tmp_path}", f"trainer.run_id={run_id}", "trainer.total_iterations=1",
                      "trainer.val_every=0", "data.train_batch_size=8", "actor.mini_batch_size=32",
                      "actor.micro_batch_size=32", env={"RLFLOW_CACHE": str(cache), **env})
        assert proc.returncode == 0, proc.stderr[-4000:]
        weights = (tmp_path / run_id / "export" / "step_000001" / "model.safetensors").read_bytes()
        metrics = json.loads((tmp_path / run_id / "metrics" / "iter_000001.json").read_text())
        return hashlib.sha256(weights).hexdigest(), metrics["critic/score/mean"], metrics["actor/pg_loss"]

    other = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41",
             "OMP_NUM_THREADS": "1"}
    with monkeypatch.context() as patch:
        for key, value in other.items():  # the other stack's Ray node (and so its workers) starts with these
            patch.setenv(key, value)
        home = tmp_path / "other-stack"
        stack = LocalStack(StackConfig(home=str(home), prefect_port=quiet_port(), ray_port=quiet_port()))
        stack.up()
    # A busy loop at the lowest priority: the machine is loaded wherever it has a free moment, but the
    # suite's other worker is not slowed (at normal priority it took half a core from it for the whole run).
    load = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(19)\nwhile True: pass"])
    try:
        there = run(cli, "there", {**other, "RLFLOW_HOME": str(home)})
    finally:
        load.kill()
        load.wait()
        stack.down()
    [report] = (cache / "models").glob("tiny-sort-s0-*/rlflow_tiny.json")
    assert report.parent.name.endswith("-avx2") and json.loads(report.read_text())["cpu_capability"] == "AVX2"
    here = run(warm_cli, "here", {})
    assert here == there
