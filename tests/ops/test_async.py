"""Asynchronous RL through the real CLI, stack and storage: split placement (1 training rank + 1 rollout
rank), trainer.max_staleness = k.

- k = 0 on the split pools gives the on-policy loop's weights bit for bit (colocated, 1 rank, with a
  rollout copy: the same ranks' seeds, the same weights reaching the generator by another path).
- k = 1: the rollout of each iteration uses the version the schedule fixes (0, 0, 1, 2), rollouts
  overlap updates in the run's timeline.
- k = 1 with partial rollouts (rollout.partial_tokens=4 of 8): the first 4 tokens of each response come
  from the version above, the rest from the next (0, 1, 2, 3), token by token in `token_version`; the
  continued tokens' importance weights are 1 (their behaviour policy is the one the update starts from),
  the first part's are not; each continuation starts after the weight sync it needs. A run whose flow
  process and engine die mid-run resumes to the uninterrupted run's weights bit for bit, keeping every
  complete buffer.
- A failed stage of an asynchronous iteration: the run goes on from where it stopped, reusing the
  iteration's finished stages.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from tests.ops.test_faults import REWARD, buffers
from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Given to the first resume (faults are not part of the config hash: the run keeps its engine and stages).
KILL_AFTER_UPDATE_3 = ("debug.kill_flow_after=update_policy", "debug.kill_iteration=3")
ITERATIONS = 4
SPLIT = ("placement.mode=split", "trainer.world_size=1", "placement.rollout_ranks=1", "placement.cpus_per_rank=1")
PARTIAL = ("trainer.max_staleness=1", "rollout.partial_tokens=4")


def args(model: Path, root: Path, run_id: str, *extra: str, iterations: int = ITERATIONS) -> list[str]:
    return [f"model.path={model}", f"storage.root={root}", f"trainer.run_id={run_id}", REWARD,
            f"trainer.total_iterations={iterations}", "trainer.save_every=3", "trainer.val_every=0",
            "data.train_batch_size=8", "actor.mini_batch_size=64", "actor.micro_batch_size=64",
            "actor.old_log_prob=recompute", "data.train_size=256",
            "data.val_size=16", "rollout.max_new_tokens=8", *extra]


def weights(root: Path, run_id: str, iterations: int = ITERATIONS) -> dict:
    from safetensors.torch import load_file

    return load_file(root / run_id / "export" / f"step_{iterations:06d}" / "model.safetensors")


def metrics(root: Path, run_id: str, iterations: int = ITERATIONS) -> list[dict]:
    return [json.loads((root / run_id / "metrics" / f"iter_{i:06d}.json").read_text())
            for i in range(1, iterations + 1)]


def assert_equal_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in got:
        assert bool((got[key] == want[key]).all()), key


@pytest.fixture(scope="module")
def reference(cli: Cli, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted asynchronous run (k = 1), in its own process: in the warm CLI its rollout of
    iteration i+1 was once seen not to start before the update of i ended (a fresh-clone run of a3142bf)."""
    root = tmp_path_factory.mktemp("async-reference")
    proc = cli("train", *args(tiny_model_dir, root, "async-ref", *SPLIT, "trainer.max_staleness=1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"root": root, "weights": weights(root, "async-ref"), "metrics": metrics(root, "async-ref")}


@pytest.fixture(scope="module")
def partial(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted asynchronous run (k = 1) with partial rollouts."""
    root = tmp_path_factory.mktemp("async-partial")
    proc = warm_cli("train", *args(tiny_model_dir, root, "async-partial", *SPLIT, *PARTIAL))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"root": root, "weights": weights(root, "async-partial"), "metrics": metrics(root, "async-partial")}


def test_k0_on_split_pools_equals_the_on_policy_loop(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Both runs take 2 iterations: the rollout of iteration 2 samples with the weights of update 1, which
    reach the generator by the sync (split) or the rollout copy (colocated), and update 2 starts from it."""
    colocated = warm_cli("train", *args(tiny_model_dir, tmp_path, "colocated", "trainer.world_size=1",
                                        "rollout.weights=copy", "placement.cpus_per_rank=1", iterations=2))
    assert colocated.returncode == 0, colocated.stderr[-4000:]
    split = warm_cli("train", *args(tiny_model_dir, tmp_path, "split-k0", *SPLIT, iterations=2))
    assert split.returncode == 0, split.stderr[-4000:]
    assert_equal_weights(weights(tmp_path, "split-k0", 2), weights(tmp_path, "colocated", 2))
    synced = metrics(tmp_path, "split-k0", 2)
    assert all(m["perf/weight_sync_mb"] > 0 and m["async/staleness"] == 0 for m in synced)


def test_async_rollouts_use_the_scheduled_versions_and_overlap_updates(reference: dict) -> None:
    lines = reference["metrics"]
    assert [m["async/rollout_version"] for m in lines] == [0, 0, 1, 2]  # max(0, i - 1 - k)
    assert [m["async/staleness"] for m in lines] == [0, 1, 1, 1]
    # Decoupled PPO's truncated importance weights (auto: truncate at 2, token level), by hand from the
    # buffers: w = exp(old_logp - rollout_logp) on the response tokens (one micro-batch of all 64 rows, so
    # the reported mean is the batch's token mean; the old log-prob pass runs: actor.old_log_prob=recompute). Stale rollouts (iterations 2-4) give weights off 1.
    from engine.batch import Batch

    for i, m in enumerate(lines, start=1):
        folder = reference["root"] / "async-ref" / "buffers" / f"iter_{i:06d}"
        rollout = Batch.from_parquet(str(folder / "rollout.parquet"))
        old = Batch.from_parquet(str(folder / "old_logprob.parquet"))
        mask = rollout["response_mask"].bool()
        w = torch.exp(old["old_logp"][mask].double() - rollout["rollout_logp"][mask].double())
        assert m["rollout_corr/is_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-5, abs=1e-6), i
        assert m["rollout_corr/is_weight_max"] == pytest.approx(float(w.max()), rel=1e-5), i
        assert m["rollout_corr/corrected_share"] == pytest.approx(float((w > 2.0).double().mean()), abs=1e-6), i
        if i > 1:
            assert float((w - 1).abs().max()) > 1e-3, i  # the version gap shows in the weights
    events = json.loads((reference["root"] / "async-ref" / "trace" / "timeline.json").read_text())["traceEvents"]
    spans = {(e["args"]["iteration"], e["name"]): (e["ts"], e["ts"] + e["dur"])
             for e in events if e["ph"] == "X" and e["pid"] == 1}
    # The rollout of i+1 does not wait for iteration i: it starts before i's update has ended (with k = 0
    # it starts after i commits), at least once. Not every time, and not always overlapping the update
    # itself: a stage attaching to the engine pings every rank, and a rank busy in a long call answers
    # after it (noted in BENCHMARKS.md section 6), so when the rollout of i+1 starts depends on timing.
    early = [i for i in range(1, ITERATIONS)
             if spans[(i + 1, "generate_rollouts")][0] < spans[(i, "update_policy")][1]]
    assert early, spans
    ranks = {(e["pid"], e["tid"]) for e in events if e["ph"] == "X" and e["pid"] != 1}
    assert len(ranks) == 2  # the training rank and the rollout rank
    # the schedule, not the timing, decides: every sync of version i came after the rollout of i + 1
    for i in range(1, ITERATIONS):
        assert spans[(i, "sync_weights")][0] >= spans[(i + 1, "generate_rollouts")][1]


@pytest.mark.effect_of("rollout.partial_tokens")
def test_partial_rollouts_continue_with_the_next_version(partial: dict) -> None:
    from engine.batch import Batch

    lines = partial["metrics"]
    assert [m["async/rollout_version"] for m in lines] == [0, 0, 1, 2]  # max(0, i - 1 - k)
    assert [m["async/continue_version"] for m in lines] == [0, 1, 2, 3]  # max(0, i - k)
    continued = 0
    for i, m in enumerate(lines, start=1):
        folder = partial["root"] / "async-partial" / "buffers" / f"iter_{i:06d}"
        rollout = Batch.from_parquet(str(folder / "rollout.parquet"))
        old = Batch.from_parquet(str(folder / "old_logprob.parquet"))
        mask, version = rollout["response_mask"].bool(), rollout["token_version"]
        head, tail = mask.clone(), mask.clone()
        head[:, 4:], tail[:, :4] = False, False
        assert bool((version[head] == max(0, i - 2)).all()) and bool((version[tail] == max(0, i - 1)).all())
        assert bool((version[~mask] == 0).all())
        continued += int(tail.sum())
        # the importance weights of the continued tokens are 1: the weights that sampled them are the
        # ones the update starts from; the first part's show the version gap
        w = torch.exp(old["old_logp"].double() - rollout["rollout_logp"].double())
        assert float((w[tail] - 1).abs().max()) < 1e-4, i
        if i > 1:
            assert float((w[head] - 1).abs().max()) > 1e-3, i
        assert m["rollout_corr/is_weight_mean"] == pytest.approx(float(w[mask].mean()), rel=1e-5, abs=1e-6), i
    assert continued > 0
    events = json.loads((partial["root"] / "async-partial" / "trace" / "timeline.json").read_text())["traceEvents"]
    spans = {(e["args"]["iteration"], e["name"]): (e["ts"], e["ts"] + e["dur"])
             for e in events if e["ph"] == "X" and e["pid"] == 1}
    for i in range(1, ITERATIONS):  # version i reaches the pool after the first part of i + 1, before its rest
        assert spans[(i + 1, "generate_rollouts")][1] <= spans[(i, "sync_weights")][0]
        assert spans[(i, "sync_weights")][1] <= spans[(i + 1, "continue_rollouts")][0]


@pytest.mark.effect_of("debug.fail_stage", "debug.fail_times", "debug.fail_iteration")
def test_failed_then_killed_async_run_resumes_like_the_uninterrupted_one(cli: Cli, warm_cli: WarmCli,
                                                                        tiny_model_dir: Path, tmp_path: Path,
                                                                        partial: dict) -> None:
    """One run carries both faults. compute_advantages of iteration 3 fails past its retries: the run fails
    with iteration 2 committed (and the rollout of 4, which overlapped, in storage). Run again, it reuses
    iteration 3's finished stages, and the flow process dies right after the update of iteration 3, its
    engine with it (a lost machine): the second resume starts a new engine, replays iterations 1-2 from
    their buffers (no checkpoint yet), gives the rollout pool version 2, and goes on to the uninterrupted
    run's weights. No complete buffer is ever rewritten."""
    failed = cli("train", *args(tiny_model_dir, tmp_path, "async-fail", *SPLIT, *PARTIAL,
                                "debug.fail_stage=compute_advantages", "debug.fail_times=3", "trainer.stage_retry_delays_s=[0,0]",
                                "debug.fail_iteration=3"))
    assert failed.returncode != 0 and failed.returncode != -signal.SIGKILL, failed.stderr[-3000:]
    assert "debug.fail_stage=compute_advantages: failure 3 of 3" in failed.stdout + failed.stderr
    assert metrics_done(tmp_path, "async-fail") == [1, 2]
    before = buffers(tmp_path, "async-fail")
    assert any("iter_000004/rollout" in k for k in before)  # generated while iteration 3 ran
    killed = cli("train", "--resume", "async-fail", f"storage.root={tmp_path}", REWARD, *KILL_AFTER_UPDATE_3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert warm_cli("engine", "stop", "async-fail").returncode == 0
    # killed by the resume, after iteration 3's update and before its commit
    assert (tmp_path / "async-fail" / "debug" / "killed_after_update_policy_000003").exists()
    assert metrics_done(tmp_path, "async-fail") == [1, 2]
    after_kill = buffers(tmp_path, "async-fail")
    assert all(after_kill[k] == v for k, v in before.items())  # iteration 3's finished stages were reused
    resumed = warm_cli("train", "--resume", "async-fail", f"storage.root={tmp_path}", REWARD)  # a process new to the run
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    logs = resumed.stdout + resumed.stderr
    assert "replaying the updates of iteration 2" in logs, logs[-3000:]
    after = buffers(tmp_path, "async-fail")
    assert all(after[k] == v for k, v in after_kill.items())  # every complete buffer kept, none rewritten
    line = metrics(tmp_path, "async-fail")[2]
    assert line["stages/reused"] >= 3  # rollout, reward, old log-probs of iteration 3
    assert_equal_weights(weights(tmp_path, "async-fail"), partial["weights"])
    assert [m["async/rollout_version"] for m in metrics(tmp_path, "async-fail")] == [0, 0, 1, 2]
    assert [m["async/continue_version"] for m in metrics(tmp_path, "async-fail")] == [0, 1, 2, 3]


def metrics_done(root: Path, run_id: str) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (root / run_id / "metrics").glob("iter_*.json"))
