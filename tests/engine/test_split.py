"""Split placement: a rollout pool next to the training pool, placement plans that fit or are refused
before any actor starts, and the bucketed weight sync between the pools (the same weights on both,
the rollout's version set only when every bucket has arrived). The importance weights of decoupled
PPO, on a case computed by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import Engine, EngineSpec, check_fits
from engine.errors import ConfigError, EngineError
from engine.state import weight_sync
from engine.workers.group import list_engines
from tests.engine.test_engine import make_spec, prompts
from tests.engine.test_lora import LORA


def split_spec(model_dir: Path, run_id: str, rollout_ranks: int = 2, bucket_mb: float = 0.25, **kw: object
               ) -> EngineSpec:
    spec = make_spec(model_dir, run_id, use_ref=False, **kw)
    return spec.model_copy(update={"rollout_ranks": rollout_ranks, "sync_bucket_mb": bucket_mb})


def test_bucket_plan_cuts_by_size_and_both_sides_agree() -> None:
    entries = [("b", (100, 10)), ("a", (10,)), ("c", (300,)), ("d", (5, 5))]
    plan = weight_sync.bucket_plan(entries, bucket_bytes=4 * 400)
    assert [[n for n, _ in b] for b in plan] == [["a"], ["b"], ["c", "d"]]  # sorted; b (4000 B) alone
    assert weight_sync.plan_digest(plan) == weight_sync.plan_digest(weight_sync.bucket_plan(entries[::-1], 1600))
    assert weight_sync.plan_digest(plan) != weight_sync.plan_digest(weight_sync.bucket_plan(entries, 8000))


def test_placement_plans_fit_or_are_refused_with_the_numbers(tiny_model_dir: Path) -> None:
    spec = split_spec(tiny_model_dir, "fit", rollout_ranks=1)  # 2 training ranks + 1 rollout rank, 1 CPU each
    check_fits(spec, {"CPU": 3.0})
    with pytest.raises(ConfigError) as err:
        check_fits(spec, {"CPU": 2.0})
    assert str(err.value) == ("the placement does not fit the Ray cluster: policy pool 2 x 1 + rollout pool 1 x 1 "
                              "= 3 CPUs, the cluster has 2; lower trainer.world_size or placement.rollout_ranks, "
                              "or add nodes")
    with pytest.raises(ConfigError, match="= 1 GPUs, the cluster has 0"):
        check_fits(spec.model_copy(update={"world_size": 1, "num_gpus_per_rank": 0.5}), {"CPU": 8.0})


@pytest.mark.slow
def test_a_plan_larger_than_the_cluster_starts_no_actor(ray_address: str, tiny_model_dir: Path) -> None:
    spec = split_spec(tiny_model_dir, "too-big", rollout_ranks=3)  # 5 CPUs on a 4-CPU cluster
    with pytest.raises(ConfigError, match="= 5 CPUs, the cluster has 4"):
        Engine.start(spec)
    assert "too-big" not in list_engines()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_bucketed_sync_gives_both_pools_the_same_weights_and_sets_the_version_last(
        ray_address: str, tiny_model_dir: Path, lora: bool) -> None:
    extra = {"lora": LORA} if lora else {}
    engine = Engine.start(split_spec(tiny_model_dir, f"sync-{lora}", **extra))
    try:
        assert engine.versions() == {"policy": 0, "rollout": 0}
        batch = engine.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)  # on the rollout pool
        assert engine.rollout is not None and set(batch["rollout_version"].tolist()) == {0}
        old = engine.compute_log_prob(batch, expected_version=0)["old_logp"]
        # The rollout's own log-probs of its tokens are the training weights' (same weights, other code path).
        mask = batch["response_mask"].bool()
        assert torch.allclose(batch["rollout_logp"][mask], old[mask], atol=1e-4)
        adv = torch.linspace(-1, 1, len(batch)).unsqueeze(1) * batch["response_mask"]
        engine.update_actor(batch.with_tensors(old_logp=old, adv=adv), iteration=1, expected_version=0)
        trained = engine.policy.call("trainable_weights")[0]  # full: every parameter; LoRA: the adapters
        stale = engine.rollout.call("full_weights")
        assert any(not torch.equal(trained[k], stale[0][k]) for k in trained)

        metrics = engine.sync_weights(1)
        assert engine.versions() == {"policy": 1, "rollout": 1}
        for rank_weights in engine.rollout.call("full_weights"):
            assert rank_weights.keys() == trained.keys()
            for key, value in trained.items():
                assert torch.equal(rank_weights[key], value), key
        sent = sum(v.numel() for v in trained.values()) * 4 / 2**20
        assert metrics["perf/weight_sync_mb"] == pytest.approx(sent)
        assert metrics["perf/weight_sync_mb_per_s"] > 0

        # A sync that stops after its first bucket leaves the rollout at its old version.
        engine.update_actor(batch.with_tensors(old_logp=old, adv=adv), iteration=2, expected_version=1)
        engine.rollout.call("debug_fault", "fail_mid_sync", 0)
        with pytest.raises(EngineError, match="weight sync stopped after bucket 0"):
            engine.sync_weights(2)
        assert engine.rollout.call("get_version", mode="rank0") == 1  # (rank 1 waits for the rest: stopped below)
    finally:
        engine.stop()
