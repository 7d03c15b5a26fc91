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
from engine.demo.synthetic import make_rows
from engine.engine import Engine, EngineSpec
from engine.errors import EngineDeadError, EngineError, EngineHungError, VersionMismatchError
from engine.models.loading import load_tokenizer
from engine.models.tokens import encode_prompts
from engine.workers.critic import CriticSpec
from engine.workers.group import list_engines
from engine.workers.policy import PolicySpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def make_spec(model_dir: Path, run_id: str, *, world_size: int = 2, use_ref: bool = True,
              critic: bool = False, rollout_weights: str = "actor", **actor: object) -> EngineSpec:
    actor_cfg = ActorConfig(**{"lr": 1e-3, "mini_batch_size": 8, "micro_batch_size": 4, **actor})
    return EngineSpec(
        run_id=run_id, config_hash="h-" + run_id, world_size=world_size, timeout_s=120,
        policy=PolicySpec(model_path=str(model_dir), tokenizer_path=str(model_dir), use_ref=use_ref,
                          rollout=RolloutConfig(max_new_tokens=8, micro_batch_size=8, weights=rollout_weights),
                          actor=actor_cfg,
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
    """A new engine for a test that changes it (an update, a load, a rank killed)."""
    eng = Engine.start(make_spec(tiny_model_dir, f"t-{request.node.name[:40].replace('[', '-').rstrip(']')}"))
    yield eng
    eng.stop()


def test_generate_logprob_update_and_weight_sync(engine: Engine, tiny_model_dir: Path, tmp_path: Path) -> None:
    """...and after the update, the log-probs of the actor, of the rollout copy it synced and of the
    exported model loaded by plain transformers agree (<= 1e-5)."""
    from engine import algos
    from engine.workers.policy import response_logits

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
    # The largest rank's peak RSS in GiB (a peak only grows: reading it again gives at least as much).
    assert 0.1 < metrics["perf/peak_rss_gb"] <= max(engine.policy.call("peak_rss_bytes")) / 2**30
    # After the sync the rollout copy generates from the new weights: log-probs now differ from ref.
    new = engine.compute_log_prob(batch, expected_version=1)
    assert not torch.allclose(new["old_logp"], ref["ref_logp"])
    with pytest.raises(VersionMismatchError, match="version 1, the call expected version 0"):
        engine.generate(prompts(tiny_model_dir), iteration=2, expected_version=0)
    actor_logp = new["old_logp"]
    rollout_logp = engine.policy.call("rollout_log_prob", batch, mode="dp")["logp"]
    engine.export_hf(str(tmp_path / "export"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        plain_logp = algos.logprobs_from_logits(response_logits(exported, batch, 1.0), batch["responses"])
    mask = batch["response_mask"].bool()
    assert float((actor_logp - rollout_logp)[mask].abs().max()) <= 1e-5
    assert float((actor_logp - plain_logp)[mask].abs().max()) <= 1e-5


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_save_stop_load_gives_a_bit_identical_next_update(backend: str, ray_address: str, tiny_model_dir: Path,
                                                          tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if backend == "s3":
        server = request.getfixturevalue("s3_server")
        url = f"s3://{server.bucket}/engine-test/{tmp_path.name}/ckpt"
        opts = {"key": server.env["AWS_ACCESS_KEY_ID"], "secret": server.env["AWS_SECRET_ACCESS_KEY"],
                "endpoint_url": server.endpoint_url}
    else:
        url, opts = str(tmp_path / "ckpt"), {}
    first = Engine.start(make_spec(tiny_model_dir, f"save-{backend}"))
    try:
        batch = first.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)
        old = first.compute_log_prob(batch, expected_version=0)
        train = batch.with_tensors(old_logp=old["old_logp"], adv=batch["response_mask"].float())
        first.update_actor(train, iteration=1, expected_version=0)
        first.save(url, opts)
        saved = first.weights_digest()
        # The group that never stops takes one more update; a restored group must match it exactly,
        # which needs the weights, the AdamW moments, the LR schedule and the RNG all restored.
        first.update_actor(train, iteration=2, expected_version=1)
        continued = first.weights_digest()
    finally:
        first.stop()
    second = Engine.start(make_spec(tiny_model_dir, f"load-{backend}"))
    try:
        assert second.load(url, opts) == 1
        assert second.weights_digest() == saved
        second.update_actor(train, iteration=2, expected_version=1)
        assert second.weights_digest() == continued
    finally:
        second.stop()


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


def test_cli_engine_list_and_stop(ray_address: str, tiny_model_dir: Path) -> None:
    eng = Engine.start(make_spec(tiny_model_dir, "cli-run", world_size=1, use_ref=False))
    repo = Path(__file__).resolve().parents[2]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flows.cli", "engine", *args, "--address", ray_address],
                              capture_output=True, text=True, timeout=120, cwd=repo)

    try:
        listed = cli("list")
        assert listed.returncode == 0, listed.stderr
        assert "cli-run" in listed.stdout and "policy" in listed.stdout
        stopped = cli("stop", "cli-run")
        assert stopped.returncode == 0 and "stopped cli-run: policy" in stopped.stdout
        assert "cli-run" not in list_engines()
        assert cli("stop", "cli-run").returncode == 1
    finally:
        eng.stop()


def test_update_without_old_logp_equals_update_with_recomputed_old_logp(ray_address: str, tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    """One PPO epoch, one mini-batch: the update's own (detached) log-probs are the old log-probs."""
    spec = make_spec(tiny_model_dir, "onpolicy", use_ref=False)  # mini-batch 8 = the whole batch below
    assert spec.policy.actor.reuses_update_logp(8, kl_in_reward=False)
    eng = Engine.start(spec)
    try:
        batch = eng.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)
        adv = torch.linspace(-1, 1, 8).unsqueeze(1) * batch["response_mask"]
        eng.save(str(tmp_path / "v0"))
        old = eng.compute_log_prob(batch, expected_version=0)
        with_old = eng.update_actor(batch.with_tensors(old_logp=old["old_logp"], adv=adv), iteration=1,
                                    expected_version=0)
        recomputed = eng.weights_digest()
        assert eng.load(str(tmp_path / "v0")) == 0
        without = eng.update_actor(batch.with_tensors(adv=adv), iteration=1, expected_version=0)
        assert eng.weights_digest() == recomputed
        assert without["actor/pg_loss"] == with_old["actor/pg_loss"]
        # the pass-free update reports what the recomputed old log-probs give (their gap to the update's own: ~0)
        assert without["actor/ppo_kl"] == pytest.approx(with_old["actor/ppo_kl"], abs=1e-6)
    finally:
        eng.stop()


def test_fsdp_communication_options_give_the_same_gradient(ray_address: str, tiny_model_dir: Path) -> None:
    """Gradients reduce-scattered once per optimizer step, and layers kept gathered from forward to
    backward: fewer collectives, the same gradient (up to float summation order). Likewise a prompt
    pass per row instead of one per distinct prompt. Compared before the optimizer step, relative to
    the gradient's norm (weights after an Adam step would hide a rescaling)."""
    batch = None
    grads = []
    for run_id, options in (("comm-default", {}),
                            ("comm-once", {"grad_sync": "optimizer_step", "reshard_after_forward": False}),
                            ("comm-unshared", {"share_prompts": False})):  # every row's prompt in its own pass
        eng = Engine.start(make_spec(tiny_model_dir, run_id, use_ref=False, **options))  # 2 micro-batches per rank
        try:
            if batch is None:
                batch = eng.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)
                adv = torch.linspace(-1, 1, 8).unsqueeze(1) * batch["response_mask"]
                batch = batch.with_tensors(adv=adv)
            grads.append(eng.policy.call("gradients", batch, mode="dp")[0])
        finally:
            eng.stop()
    norm = torch.cat([g.flatten() for g in grads[0].values()]).norm()
    assert norm > 0
    for other in grads[1:]:
        diff = torch.cat([(other[k] - grads[0][k]).flatten() for k in grads[0]]).norm()
        assert float(diff / norm) <= 1e-5, float(diff / norm)


def test_no_model_of_the_engine_drops_anything(ray_address: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    """Actor, rollout copy (rollout.weights=copy), ref and critic of a model whose config sets attention
    dropout 0.1 (the critic's head would default to 0.1 too): every rate is 0, so values and log-probs
    are repeatable."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    spec = make_spec(model, "no-dropout", critic=True)
    spec.policy.rollout.weights = "copy"
    eng = Engine.start(spec)
    try:
        reports = eng.policy.call("dropout_left") + eng.critic.call("dropout_left")
        assert {name for r in reports for name in r} == {"actor", "rollout copy", "ref", "critic"}
        assert all(not left for r in reports for left in r.values()), reports
        batch = eng.generate(prompts(model), iteration=1, expected_version=0)
        first, again = (eng.compute_values(batch, expected_version=0)["values"] for _ in range(2))
        assert torch.equal(first, again)
    finally:
        eng.stop()


def test_logged_lr_is_the_rate_the_step_used(ray_address: str, tiny_model_dir: Path) -> None:
    """Linear warmup over 4 updates: update k steps with lr * k / 4 and logs that rate (verl logs the
    rate before the scheduler moves on), for the actor and the critic."""
    spec = make_spec(tiny_model_dir, "lr-log", use_ref=False, critic=True, warmup_steps=4)
    spec.critic.critic.warmup_steps = 4
    eng = Engine.start(spec)
    try:
        batch = eng.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)
        train = batch.with_tensors(adv=batch["response_mask"].float(), values=torch.zeros(8, 8),
                                   returns=batch["response_mask"].float())
        for it in (1, 2):
            actor = eng.update_actor(train, iteration=it, expected_version=it - 1)
            critic = eng.update_critic(train, iteration=it, expected_version=it - 1)
            assert actor["actor/lr"] == pytest.approx(1e-3 * it / 4)
            assert critic["critic/lr"] == pytest.approx(spec.critic.critic.lr * it / 4)
    finally:
        eng.stop()


def test_responses_of_1024_tokens_and_their_clip_ratio(ray_address: str, tmp_path: Path) -> None:
    """rollout.max_new_tokens=1024 on a Qwen2-shaped model (positions up to 2048): responses that long are
    generated and trained on (token-budget micro-batches), and response_length/clip_ratio is the share
    of responses that hit the limit."""
    from engine.advantage import data_metrics
    from engine.demo.families import build_family

    model = build_family("qwen2", tmp_path / "qwen2", task="arith")
    spec = make_spec(model, "long-responses", use_ref=False, max_tokens_per_micro_batch=2400)
    spec.policy.rollout.max_new_tokens = 1024
    eng = Engine.start(spec)
    try:
        # Greedy, this random model loops without a stop token to the limit; sampled, it stops sooner.
        greedy = eng.generate(prompts(model, n=4, repeat=1), iteration=1, expected_version=0, do_sample=False)
        sampled = eng.generate(prompts(model, n=4, repeat=1), iteration=1, expected_version=0)
        batch = Batch.concat([greedy, sampled])
        lengths = batch["response_mask"].sum(-1)
        print("response lengths:", lengths.tolist())
        assert batch["responses"].shape[1] == 1024 and 0 < int((lengths == 1024).sum()) < len(batch)
        scored = batch.with_tensors(token_scores=torch.zeros(batch["responses"].shape))
        metrics = data_metrics(scored, max_new_tokens=1024)
        assert metrics["response_length/clip_ratio"] == pytest.approx(float((lengths == 1024).float().mean()))
        assert metrics["response_length/max"] == float(lengths.max())
        train = batch.with_tensors(adv=torch.linspace(-1, 1, len(batch)).unsqueeze(1) * batch["response_mask"])
        out = eng.update_actor(train, iteration=1, expected_version=0)
        assert out["actor/grad_norm"] > 0 and out["actor/pg_loss"] == out["actor/pg_loss"]
    finally:
        eng.stop()


# The tests that share one engine come last: it lives until the module ends.


# -- one engine for the memory figures, the refused loads and the rank errors: a refused load changes
# nothing, and the rank errors come last (the last one kills rank 1). In this order, in this file; the memory
# test before the unchanged engine starts (the head's 4 CPUs: this engine's 2 and a 1-rank one, then the
# unchanged engine's 2).
@pytest.fixture(scope="module")
def scratch_engine(ray_address: str, tiny_model_dir: Path):
    eng = Engine.start(make_spec(tiny_model_dir, "scratch"))
    yield eng
    eng.stop()


def test_parameter_and_optimizer_bytes_per_rank_halve(ray_address: str, tiny_model_dir: Path,
                                                      scratch_engine: Engine) -> None:
    """One rank against the module's 2-rank engine (its update here creates the AdamW moments; the tests
    after it save and load their own checkpoints)."""
    sizes = {}
    one = Engine.start(make_spec(tiny_model_dir, "mem-1", world_size=1, use_ref=False))
    try:
        for world, eng in ((1, one), (2, scratch_engine)):
            batch = eng.generate(prompts(tiny_model_dir), iteration=1, expected_version=0)
            old = eng.compute_log_prob(batch, expected_version=0)
            eng.update_actor(batch.with_tensors(old_logp=old["old_logp"], adv=batch["response_mask"].float()),
                             iteration=1, expected_version=0)  # creates the AdamW moments
            sizes[world] = eng.policy.call("memory_bytes")
    finally:
        one.stop()
    one_rank = sizes[1][0]["params"] + sizes[1][0]["optimizer"]
    for rank in (0, 1):
        two = sizes[2][rank]["params"] + sizes[2][rank]["optimizer"]
        print(f"rank {rank}: {two} parameter+optimizer bytes with 2 ranks, {one_rank} with 1 ({two / one_rank:.3f})")
        assert 0.45 <= two / one_rank <= 0.55


@pytest.fixture(scope="module")
def unchanged_engine(ray_address: str, tiny_model_dir: Path):
    """One engine for the tests that only read it (generate, export, attach). The generate and attach
    tests expect version 0: a test that changed the engine would make them fail, not pass. These tests come
    last in the file: the engine holds its ranks' CPUs until the module ends."""
    eng = Engine.start(make_spec(tiny_model_dir, "t-unchanged"))
    yield eng
    eng.stop()


def test_generation_is_reproducible_for_the_same_iteration(unchanged_engine: Engine, tiny_model_dir: Path) -> None:
    a = unchanged_engine.generate(prompts(tiny_model_dir), iteration=3, expected_version=0)
    b = unchanged_engine.generate(prompts(tiny_model_dir), iteration=3, expected_version=0)
    c = unchanged_engine.generate(prompts(tiny_model_dir), iteration=4, expected_version=0)
    assert torch.equal(a["responses"], b["responses"])
    assert not torch.equal(a["responses"], c["responses"])


def test_generate_n_responses_per_prompt_with_eos_masks(unchanged_engine: Engine, tiny_model_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    out = unchanged_engine.generate(prompts(tiny_model_dir, n=3, repeat=4), iteration=1, expected_version=0)
    assert out["responses"].shape[0] == 12
    assert out["ground_truth"] == [g for g in out["ground_truth"][::4] for _ in range(4)]
    eos = tok.eos_token_id
    ended = 0
    for resp, mask in zip(out["responses"].tolist(), out["response_mask"].tolist()):
        n = sum(mask)
        assert mask == [1] * n + [0] * (len(mask) - n)  # a prefix
        if eos in resp:
            ended += 1
            first = resp.index(eos)
            assert n == first + 1  # the eos itself counts, nothing after it
            assert all(t == tok.pad_token_id for t in resp[first + 1:])
        else:
            assert n == len(resp)  # ran out of tokens: all of it counts
    assert ended > 0  # the warm-started model does stop


def test_export_loads_with_plain_transformers(unchanged_engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / "export"
    unchanged_engine.export_hf(str(out))
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("1+2=", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]


def test_another_process_attaches_by_name(unchanged_engine: Engine, ray_address: str) -> None:
    run_id = unchanged_engine.spec.run_id
    assert run_id in list_engines()
    script = textwrap.dedent(f"""
        import ray
        from engine.workers.group import WorkerGroup
        from engine.errors import EngineError
        ray.init(address={ray_address!r}, namespace="rlflow", log_to_driver=False)
        group = WorkerGroup.attach(run_id={run_id!r}, role="policy",
                                   config_hash={unchanged_engine.spec.config_hash!r})
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


def test_a_shard_only_one_rank_reads_is_reported_corrupt_by_every_rank(scratch_engine: Engine, tmp_path: Path) -> None:
    """Rank 0 alone reads its shard file; when that file is corrupt, rank 1 must say so too: the engine
    takes whichever rank answers first, and only a CheckpointCorruptError makes the restore fall back
    to an older checkpoint (before, rank 1 raised a plain error: a fallback that depended on timing)."""
    import hashlib

    import ray

    from engine.state.checkpoint_io import CheckpointCorruptError

    url = tmp_path / "ckpt"
    records = scratch_engine.save(str(url))
    expected = {r["path"][len("policy/"):]: (r["size"], r["sha256"]) for r in records}
    shard = url / "policy" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert hashlib.sha256(bytes(data)).hexdigest() != expected["__0_0.distcp"][1]
    refs = [actor.load.remote(str(url / "policy"), {}, expected) for actor in scratch_engine.policy.actors]
    for rank, ref in enumerate(refs):
        with pytest.raises(ray.exceptions.RayTaskError) as caught:
            ray.get(ref, timeout=120)
        assert isinstance(caught.value.cause, CheckpointCorruptError), (rank, caught.value.cause)
        assert "__0_0.distcp is corrupt" in str(caught.value.cause), (rank, caught.value.cause)


def test_a_pickle_in_the_extra_state_is_refused_not_run(scratch_engine: Engine, tmp_path: Path) -> None:
    """extra_rank<r>.pt is read with weights_only: a crafted pickle in the bucket runs nothing."""
    import io

    class Payload:
        def __reduce__(self):  # noqa: ANN204 - what an attacker would write
            return (Path.touch, (tmp_path / "pwned",))

    url = tmp_path / "ckpt"
    scratch_engine.save(str(url))
    crafted = io.BytesIO()
    torch.save({"scheduler": Payload()}, crafted)  # a valid torch file whose pickle calls a function
    (url / "policy" / "extra_rank0.pt").write_bytes(crafted.getvalue())
    with pytest.raises(EngineError, match="rank 0 failed in load: .*Weights only load failed"):
        scratch_engine.load(str(url))
    assert not (tmp_path / "pwned").exists()


def test_rank_errors_reach_the_caller(scratch_engine: Engine) -> None:
    with pytest.raises(EngineError, match=r"rank 1 failed in debug_fault: .*fault injected on rank 1"):
        scratch_engine.policy.call("debug_fault", "raise", 1)
    with pytest.raises(EngineHungError, match=r"rank\(s\) \[0\] made no progress in debug_fault for 2 s"):
        scratch_engine.policy.call("debug_fault", "hang", 0, 5.0, timeout_s=2)
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        scratch_engine.policy.call("debug_fault", "exit", 1)
