"""DAPO's dynamic sampling through the real CLI, stack and storage (algorithm.filter_groups=true): the
arith task's exact-match reward, on which many groups of the tiny model score all 0 (or all 1).

- Every kept group's rewards differ; the sampler steps of an iteration follow on from the previous
  iteration's (no prompt skipped or drawn twice); the metrics count the batches and groups; trainer.json
  of a checkpoint holds the sampler step the next iteration starts at.
- The flow process and its engine killed after an update, then resumed: the uninterrupted run's weights
  bit for bit, every complete buffer kept (a replayed rollout would draw and filter again).
- A stage that fails past its retries: the run is run again and reuses the iteration's rollout.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from engine.batch import Batch
from engine.data.sampler import PromptSampler
from tests.ops.test_async import assert_equal_weights, metrics_done
from tests.ops.test_faults import buffers
from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Given to the first resume (faults are not part of the config hash: the run keeps its engine and stages).
KILL_AFTER_UPDATE_2 = ("debug.kill_flow_after=update_policy", "debug.kill_iteration=2")
ITERATIONS, N, PROMPTS, DRAWS = 3, 4, 4, 3


def args(model: Path, root: Path, run_id: str, *extra: str) -> list[str]:
    return [f"model.path={model}", f"storage.root={root}", f"trainer.run_id={run_id}",
            f"trainer.total_iterations={ITERATIONS}", "trainer.save_every=1", "trainer.val_every=0",
            f"data.train_batch_size={PROMPTS}", f"rollout.n={N}", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
            "data.train_size=64", "data.val_size=8", "rollout.max_new_tokens=8", "actor.lr=1e-3",
            "algorithm.filter_groups=true", f"algorithm.max_num_gen_batches={DRAWS}", *extra]


def buffer(root: Path, run_id: str, iteration: int, name: str) -> Batch:
    return Batch.from_parquet(str(root / run_id / "buffers" / f"iter_{iteration:06d}" / f"{name}.parquet"))


def metrics(root: Path, run_id: str, iterations: int = ITERATIONS) -> list[dict]:
    return [json.loads((root / run_id / "metrics" / f"iter_{i:06d}.json").read_text())
            for i in range(1, iterations + 1)]


def weights(root: Path, run_id: str, iterations: int = ITERATIONS) -> dict:
    from safetensors.torch import load_file

    return load_file(root / run_id / "export" / f"step_{iterations:06d}" / "model.safetensors")


@pytest.fixture(scope="module")
def reference(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("dynamic-reference")
    proc = warm_cli("train", *args(tiny_model_dir, root, "ds-ref"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"root": root, "weights": weights(root, "ds-ref"), "metrics": metrics(root, "ds-ref"),
            "logs": proc.stdout + proc.stderr}


@pytest.mark.effect_of("algorithm.filter_groups")
def test_kept_groups_differ_and_the_sampler_follows_on(reference: dict) -> None:
    root, lines = reference["root"], reference["metrics"]
    step = 0
    drawn_rows: list[int] = []
    for i, line in enumerate(lines, start=1):
        rollout, reward = buffer(root, "ds-ref", i, "rollout"), buffer(root, "ds-ref", i, "reward")
        kept, filled = int(line["sampling/groups_kept"]), int(line["sampling/groups_filled"])
        assert kept + filled == PROMPTS and len(rollout) == PROMPTS * N
        assert line["sampling/groups_drawn"] == PROMPTS * line["sampling/gen_batches"]
        varied = reward["score"].view(-1, N).std(dim=1) > 0
        assert varied.tolist() == [True] * kept + [False] * filled  # kept first, then the fill
        assert rollout["group_id"].tolist() == [g for g in range(PROMPTS) for _ in range(N)]
        # the rows came from the sampler steps that follow the previous iteration's
        draws = int(line["sampling/gen_batches"])
        assert line["sampling/next_step"] == step + draws
        sampler = PromptSampler(64, PROMPTS, 0)
        sampler.seek(step)
        rows = [r for _ in range(draws) for r in sampler.next_indices()]
        assert set(rollout["row_index"].tolist()) <= set(rows)
        drawn_rows += rows
        step += draws
        adv = buffer(root, "ds-ref", i, "advantage")
        assert bool((adv["adv"].abs().sum(dim=1).view(-1, N).sum(dim=1)[:kept] > 0).all())
        # the next iteration reads where this one ended from its rollout buffer's record, the one source
        assert buffer(root, "ds-ref", i, "rollout").meta["metrics"]["sampling/next_step"] == step
    assert len(drawn_rows) == len(set(drawn_rows))  # within the epoch: none twice
    assert sum(line["sampling/gen_batches"] for line in lines) > ITERATIONS  # some groups were dropped
    print("dynamic sampling:", [(m["sampling/gen_batches"], m["sampling/groups_kept"], m["sampling/groups_filled"])
                                for m in lines])


@pytest.mark.effect_of("debug.kill_flow_after")
def test_failed_then_killed_dynamic_sampling_run_resumes_like_the_uninterrupted_one(
        cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path, reference: dict) -> None:
    """One run carries both faults: compute_advantages of iteration 2 fails past its retries (the run
    fails with iteration 1 committed); run again, it reuses iteration 2's rollout and is killed, flow and
    engine, right after that iteration's update; the second resume starts a new engine and ends with the
    uninterrupted run's weights and sampler steps. No complete buffer is ever rewritten."""
    failed = cli("train", *args(tiny_model_dir, tmp_path, "ds-fail", "debug.fail_stage=compute_advantages",
                                "debug.fail_times=3", "trainer.stage_retry_delays_s=[0,0]", "debug.fail_iteration=2"))
    assert failed.returncode != 0 and failed.returncode != -signal.SIGKILL, failed.stderr[-3000:]
    assert metrics_done(tmp_path, "ds-fail") == [1]
    before = buffers(tmp_path, "ds-fail")
    assert any("iter_000002/rollout" in k for k in before)
    killed = cli("train", "--resume", "ds-fail", f"storage.root={tmp_path}", *KILL_AFTER_UPDATE_2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert warm_cli("engine", "stop", "ds-fail").returncode == 0
    # killed by the resume, after iteration 2's update and before its commit
    assert (tmp_path / "ds-fail" / "debug" / "killed_after_update_policy_000002").exists()
    assert metrics_done(tmp_path, "ds-fail") == [1]
    after_kill = buffers(tmp_path, "ds-fail")
    assert all(after_kill[k] == v for k, v in before.items())  # the failed iteration's rollout was reused
    again = warm_cli("train", "--resume", "ds-fail", f"storage.root={tmp_path}")  # a process new to the run
    assert again.returncode == 0, again.stderr[-4000:]
    after = buffers(tmp_path, "ds-fail")
    assert all(after[k] == v for k, v in after_kill.items())  # every complete buffer kept, none rewritten
    assert metrics(tmp_path, "ds-fail")[1]["stages/reused"] >= 2  # the rollout and the reward of iteration 2
    assert_equal_weights(weights(tmp_path, "ds-fail"), reference["weights"])
    got = metrics(tmp_path, "ds-fail")
    for key in ("sampling/next_step", "sampling/groups_kept", "critic/score/mean"):
        assert [m[key] for m in got] == [m[key] for m in reference["metrics"]], key
