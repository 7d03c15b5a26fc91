"""The hybrid engine on a real Ray head: FSDP2 ranks that generate, score, train, save and restore."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.batch import Batch
from engine.config import ActorConfig, CriticConfig, RolloutConfig
from engine.engine import Engine, EngineSpec
from engine.errors import EngineDeadError, EngineError, VersionMismatchError
from engine.models import encode_prompts, load_tokenizer
from engine.synthetic import make_rows
from engine.workers.critic import CriticSpec
from engine.workers.group import list_engines
from engine.workers.policy import PolicySpec

pytestmark = pytest.mark.integration


def make_spec(model_dir: Path, run_id: str, *, world_size: int = 2, use_ref: bool = True,
              critic: bool = False, **actor: object) -> EngineSpec:
    actor_cfg = ActorConfig(**{"lr": 1e-3, "mini_batch_size": 8, "micro_batch_size": 4, **actor})
    return EngineSpec(
        run_id=run_id, config_hash="h-" + run_id, world_size=world_size, timeout_s=120,
        policy=PolicySpec(model_path=str(model_dir), tokenizer_path=str(model_dir), use_ref=use_ref,
                          rollout=RolloutConfig(max_new_tokens=8, micro_batch_size=8), actor=actor_cfg,
                          total_iterations=10),
        critic=CriticSpec(model_path=str(model_dir), critic=CriticConfig(lr=1e-3, mini_batch_size=8,
                                                                        micro_batch_size=4)) if critic else None,
    )


def prompts(model_dir: Path, n: int = 4, repeat: int = 2) -> Batch:
    tok = load_tokenizer(str(model_dir))
    rows = make_rows("arith", n, seed=1)
    enc = encode_prompts(tok, [r["prompt"] for r in rows])
    batch = Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask},
                  {"ground_truth": [r["reward_model"]["ground_truth"] for r in rows]})
    return batch.repeat_interleave(repeat)


@pytest.fixture
def engine(ray_address: str, tiny_model_dir: Path, request: pytest.FixtureRequest):
    eng = Engine.start(make_spec(tiny_model_dir, f"t-{request.node.name[:40].replace('[', '-').rstrip(']')}"))
    yield eng
    eng.stop()


def test_generate_logprob_update_and_weight_sync(engine: Engine, tiny_model_dir: Path) -> None:
    batch = engine.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)
    assert batch["responses"].shape == (8, 8)
    assert batch["input_ids"].shape[1] == batch["prompt_ids"].shape[1] + 8
    assert batch["ground_truth"][:2] == [batch["ground_truth"][0]] * 2  # columns survive the dp split
    old = engine.compute_log_prob(batch, expected_version=0)
    ref = engine.compute_ref_log_prob(batch)
    # Before any update the actor is the reference: identical log-probs.
    torch.testing.assert_close(old["old_logp"], ref["ref_logp"])
    assert torch.all(old["old_logp"] <= 0)
    before = engine.weights_digest()
    adv = torch.randn(8, 1).expand(8, 8).contiguous() * batch["response_mask"]
    train = batch.with_tensors(old_logp=old["old_logp"], adv=adv)
    metrics = engine.update_actor(train, iteration=1, expected_version=0)
    assert engine.version() == 1
    assert engine.weights_digest() != before
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                "actor/lr", "timing_s/weight_sync"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    # After the sync the rollout copy generates from the new weights: log-probs now differ from ref.
    new = engine.compute_log_prob(batch, expected_version=1)
    assert not torch.allclose(new["old_logp"], ref["ref_logp"])
    with pytest.raises(VersionMismatchError, match="version 1, the call expected version 0"):
        engine.generate(prompts(tiny_model_dir), iteration=2, expected_version=0)


def test_generation_is_reproducible_for_the_same_iteration(engine: Engine, tiny_model_dir: Path) -> None:
    a = engine.generate(prompts(tiny_model_dir), iteration=3, expected_version=0)
    b = engine.generate(prompts(tiny_model_dir), iteration=3, expected_version=0)
    c = engine.generate(prompts(tiny_model_dir), iteration=4, expected_version=0)
    assert torch.equal(a["responses"], b["responses"])
    assert not torch.equal(a["responses"], c["responses"])


def test_sharded_update_matches_one_process(ray_address: str, tiny_model_dir: Path) -> None:
    """Two FSDP2 ranks and one rank apply the same update (sharded vs single process)."""
    digests, losses = [], []
    batch = None
    for world in (1, 2):
        eng = Engine.start(make_spec(tiny_model_dir, f"equiv-{world}", world_size=world, use_ref=False))
        try:
            if batch is None:
                batch = eng.generate(prompts(tiny_model_dir), iteration=1, expected_version=0, do_sample=False)
                old = eng.compute_log_prob(batch, expected_version=0)
                adv = torch.linspace(-1, 1, 8).unsqueeze(1) * batch["response_mask"]
                batch = batch.with_tensors(old_logp=old["old_logp"], adv=adv)
            losses.append(eng.update_actor(batch, iteration=1, expected_version=0)["actor/pg_loss"])
            digests.append(eng.policy.call("full_weights")[0])
        finally:
            eng.stop()
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    for key in digests[0]:
        torch.testing.assert_close(digests[0][key], digests[1][key], atol=1e-5, rtol=1e-4)


def test_save_load_restores_weights_optimizer_and_version(engine: Engine, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    batch = engine.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)
    old = engine.compute_log_prob(batch, expected_version=0)
    train = batch.with_tensors(old_logp=old["old_logp"], adv=batch["response_mask"].float())
    engine.update_actor(train, iteration=1, expected_version=0)
    engine.save(str(tmp_path / "ckpt"))
    saved = engine.weights_digest()
    # One more update on the live engine, and the same update on a restored engine: equal results
    # only if the optimizer moments, scheduler and weights all came back.
    engine.update_actor(train, iteration=2, expected_version=1)
    continued = engine.weights_digest()
    other = Engine.start(make_spec(tiny_model_dir, "restored"))
    try:
        assert other.load(str(tmp_path / "ckpt")) == 1
        assert other.weights_digest() == saved
        other.update_actor(train, iteration=2, expected_version=1)
        assert other.weights_digest() == continued
    finally:
        other.stop()


def test_export_loads_with_plain_transformers(engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / "export"
    engine.export_hf(str(out))
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("1+2=", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]


def test_rank_errors_reach_the_caller(engine: Engine) -> None:
    with pytest.raises(EngineError, match=r"rank 1 failed in debug_fault: .*fault injected on rank 1"):
        engine.policy.call("debug_fault", "raise", 1)
    with pytest.raises(EngineError, match=r"did not finish debug_fault within 2 s"):
        engine.policy.call("debug_fault", "hang", 0, 5.0, timeout_s=2)
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        engine.policy.call("debug_fault", "exit", 1)


def test_another_process_attaches_by_name(engine: Engine, ray_address: str) -> None:
    run_id = engine.spec.run_id
    assert run_id in list_engines()
    script = textwrap.dedent(f"""
        import ray
        from engine.workers.group import WorkerGroup
        from engine.errors import EngineError
        ray.init(address={ray_address!r}, namespace="rlflow", log_to_driver=False)
        group = WorkerGroup.attach(run_id={run_id!r}, role="policy", config_hash={engine.spec.config_hash!r})
        print("versions", [p["version"] for p in group.health()])
        try:
            WorkerGroup.attach(run_id={run_id!r}, role="policy", config_hash="other")
        except EngineError as err:
            print("refused:", err)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert "versions [0, 0]" in proc.stdout, proc.stderr[-3000:]
    assert "refused: the live policy workers of run" in proc.stdout
    assert "rlflow engine stop" in proc.stdout


def test_critic_values_and_update(ray_address: str, tiny_model_dir: Path) -> None:
    eng = Engine.start(make_spec(tiny_model_dir, "critic", use_ref=False, critic=True))
    try:
        batch = eng.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)
        values = eng.compute_values(batch, expected_version=0)["values"]
        assert values.shape == (8, 8)
        train = batch.with_tensors(values=values, returns=torch.ones(8, 8) * batch["response_mask"])
        first = eng.update_critic(train, iteration=1, expected_version=0)
        for it in range(2, 6):
            last = eng.update_critic(train, iteration=it, expected_version=it - 1)
        assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"} <= set(last)
        assert last["critic/vf_loss"] < first["critic/vf_loss"]
    finally:
        eng.stop()
