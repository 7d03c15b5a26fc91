"""What a setting changes, at the place where it acts, from the config as `load_config` builds it: the
prompts a stage draws (tasks.context), the rollout's sampling (policy.generate_batch), the update's
gradient (PolicyWorker.gradients), the room the engine asks the cluster for (engine.check_fits), and a
policy rank set up from the config (PolicyWorker.setup: its rollout, log-probs, weight sync and two
updates of the tiny model). Each test is marked `effect_of` with the fields it shows;
tests/pipeline/test_every_field.py names it for them.

No Ray, no run: the tiny model's files, a local storage root in tmp_path, one process (a torch.distributed
group of one for the rank).
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.batch import Batch
from engine.errors import ConfigError
from flows.config import RLConfig, load_config
from tests.engine.bigram import Bigram

HERE = Path(__file__).resolve().parent
REWARD = f"reward.function={HERE / 'rewards.py'}:digit_share"
_RUN_IDS = itertools.count()


# -- the prompts of a step: open_run's plan, the stage context's dataset and sampler -----------------

@pytest.fixture
def open_plan(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The plan of a run opened with the settings (flows.plan.open_run, its lease released): 32 synthetic
    rows, 2 prompts x 2 responses unless the settings say otherwise."""
    from flows.plan import open_run

    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))  # the synthetic files are written there

    def opened(*settings: str) -> Any:
        cfg = load_config(None, [f"model.path={tiny_model_dir}", f"storage.root={tmp_path / 'runs'}", REWARD,
                                 f"trainer.run_id=p{next(_RUN_IDS)}", "data.train_size=32", "data.val_size=8",
                                 "data.train_batch_size=2", "rollout.n=2", *settings])
        run = open_run(cfg, str(cfg.trainer.run_id), resume=False)
        run.lease.release()
        return run.plan

    return opened


@pytest.fixture
def prompts(open_plan: Any) -> Any:
    """(train dataset, the prompt batch of sampler step 0) of a run opened with the settings, as a stage
    process sees them (tasks.context)."""
    from tasks.context import context

    def opened(*settings: str) -> tuple[Any, Batch]:
        ctx = context(open_plan(*settings))
        return ctx.dataset("train"), ctx.prompts_at_step(0)

    return opened


def contents(dataset: Any) -> list[str]:
    return [row.prompt[-1]["content"] for row in dataset]


@pytest.mark.effect_of("data.train_batch_size", "rollout.n", "data.shuffle", "data.seed")
def test_a_steps_prompts_follow_the_batch_and_sampler_settings(prompts: Any) -> None:
    """A step's batch holds data.train_batch_size prompts, each rollout.n times in a row; their rows are
    the sampler's: file order without shuffle, another permutation with another seed."""
    _, base = prompts()
    rows = base["row_index"].tolist()
    assert len(base) == 4 and rows[0] == rows[1] and rows[2] == rows[3] and rows[0] != rows[2]
    _, bigger = prompts("data.train_batch_size=3")
    assert len(bigger) == 6 and len(set(bigger["row_index"].tolist())) == 3
    _, more = prompts("rollout.n=3")
    assert more["row_index"].tolist() == [rows[0]] * 3 + [rows[2]] * 3
    assert torch.equal(more["input_ids"][:3], base["input_ids"][:1].expand(3, -1))
    _, ordered = prompts("data.shuffle=false")
    assert ordered["row_index"].tolist() == [0, 0, 1, 1] and rows != [0, 0, 1, 1]
    _, reseeded = prompts("data.seed=1")
    assert reseeded["row_index"].tolist() != rows


@pytest.mark.effect_of("data.task", "data.train_size", "data.max_prompt_length", "data.truncation")
def test_the_training_prompts_follow_the_data_settings(prompts: Any) -> None:
    """The synthetic task's prompts and their number; a prompt over data.max_prompt_length is dropped
    (the default), or cut on the side data.truncation names."""
    sort, base = prompts()  # the default task: sort
    assert len(sort) == 32 and {r.data_source for r in sort} == {"rlflow/sort"}
    arith, _ = prompts("data.task=arith")
    assert {r.data_source for r in arith} == {"rlflow/arith"} and contents(arith) != contents(sort)
    fewer, _ = prompts("data.train_size=16")
    assert len(fewer) == 16
    first = base["input_ids"][0][base["attention_mask"][0].bool()].tolist()  # step 0's first prompt, encoded
    short, _ = prompts(f"data.max_prompt_length={len(first) - 1}")
    assert 0 < len(short) < len(sort)  # that prompt, and any as long, dropped
    cut = len(first) - 2
    _, left = prompts(f"data.max_prompt_length={cut}", "data.truncation=left")
    right_rows, right = prompts(f"data.max_prompt_length={cut}", "data.truncation=right")
    assert len(right_rows) == 32  # cut, not dropped: step 0 draws the same rows
    assert left["row_index"].tolist() == right["row_index"].tolist() == base["row_index"].tolist()
    assert left["input_ids"].shape[1] == right["input_ids"].shape[1] == cut
    assert left["input_ids"][0].tolist() == first[-cut:] and right["input_ids"][0].tolist() == first[:cut]


@pytest.mark.effect_of("trainer.stage_timeout_s", "trainer.stage_timeouts", "trainer.stage_retry_delays_s",
                       "ray.namespace")
def test_a_stages_engine_calls_and_retries_follow_the_trainer_settings(open_plan: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage attaches to the run's engine (tasks.context.StageContext.engine) with its calls' timeout,
    stage by stage, in the run's Ray namespace; its Prefect task retries once per configured delay."""
    from engine import engine as engines
    from tasks.context import context
    from tasks.stages import task_for

    class Attached(Exception):
        pass

    def attach(**kwargs: Any) -> None:  # WorkerGroup.attach, stopped before it looks for actors
        raise Attached(kwargs)

    monkeypatch.setattr(engines.WorkerGroup, "attach", attach)

    def attached(plan: Any, stage: str) -> tuple[float, str, str]:
        with pytest.raises(Attached) as got:
            context(plan).engine(stage)
        kwargs = got.value.args[0]
        return kwargs["timeout_s"], kwargs["timeout_setting"], kwargs["namespace"]

    default = open_plan()
    assert attached(default, "update_policy") == (1800.0, "trainer.stage_timeout_s (default, scaled with the batch)",
                                                  "rlflow")
    plan = open_plan("trainer.stage_timeout_s=900", "trainer.stage_timeouts={update_policy: 20}",
                     "trainer.stage_retry_delays_s=[0.5]", "ray.namespace=elsewhere")
    assert attached(plan, "generate_rollouts") == (900.0, "trainer.stage_timeout_s", "elsewhere")
    assert attached(plan, "update_policy") == (20.0, "trainer.stage_timeouts.update_policy", "elsewhere")
    stage = plan.stages[0]
    assert (task_for(stage, default).retries, task_for(stage, default).retry_delay_seconds) == (2, [2.0, 10.0])
    assert (task_for(stage, plan).retries, task_for(stage, plan).retry_delay_seconds) == (1, [0.5])


@pytest.mark.effect_of("ray.address", "ray.namespace")
def test_rlflow_train_joins_the_configured_ray_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.address: `rlflow train` starts no local Ray head and its driver joins that cluster
    (infra.stack.ensure_stack, then flows.train.connect_ray), in ray.namespace."""
    import ray

    from flows import train
    from infra.config import StackConfig
    from infra.stack import ensure_stack

    joined: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: joined.append(kwargs))
    monkeypatch.setattr(train, "_connected", None)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    cfg = load_config(None, ["ray.address=10.1.2.3:6379", "ray.namespace=elsewhere"])
    # an external Prefect API too: nothing of the local stack is started
    info = ensure_stack(StackConfig(prefect_api_url="http://127.0.0.1:9/api"), cfg.ray)
    assert info.ray_address == "10.1.2.3:6379"
    train.connect_ray(info.ray_address, cfg)
    assert [(j["address"], j["namespace"]) for j in joined] == [("10.1.2.3:6379", "elsewhere")]


# -- the rollout's sampling: generate_batch with the config's rollout section -------------------------

@pytest.fixture(scope="module")
def tiny_rollout(tiny_model_dir: Path) -> tuple[Any, Any, Batch]:
    """(the tiny model, its HF rollout, 4 encoded prompts)."""
    from engine.models.loading import load_model, load_tokenizer
    from engine.models.tokens import encode_prompts, stop_token_ids
    from engine.rollout.hf import HFRollout

    tok = load_tokenizer(str(tiny_model_dir))
    model = load_model(str(tiny_model_dir), dtype="float32")
    rollout = HFRollout(model, int(tok.pad_token_id), sorted(stop_token_ids(tok, model)))
    enc = encode_prompts(tok, [[{"role": "user", "content": f"{a} + {a + 3} ="}] for a in range(4)])
    return model, rollout, Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}, {})


def generated(tiny_rollout: tuple[Any, Any, Batch], *settings: str, do_sample: bool = True) -> Batch:
    from engine.workers.policy import generate_batch

    cfg = load_config(None, ["rollout.max_new_tokens=5", *settings])
    _, rollout, batch = tiny_rollout
    return generate_batch(rollout, batch, cfg.rollout, seed=0, iteration=1, rank=0, do_sample=do_sample, version=0)


def trainer_logp(model: Any, batch: Batch, temperature: float) -> torch.Tensor:
    """The trainer's log-probs of the batch's responses at `temperature` (policy.response_logits)."""
    from engine import algos
    from engine.workers.policy import response_logits

    with torch.no_grad():
        return algos.logprobs_from_logits(response_logits(model, batch, temperature, "padded"), batch["responses"])


@pytest.mark.effect_of("rollout.temperature", "rollout.top_k", "rollout.top_p")
def test_the_rollout_samples_with_the_rollout_settings(tiny_rollout: tuple[Any, Any, Batch]) -> None:
    """rollout.temperature: the rollout's log-probs are those of the tempered distribution (the trainer
    scores with the same); top_k=1 or a tiny top_p keep only the likeliest token: the draws are greedy."""
    model = tiny_rollout[0]
    greedy = generated(tiny_rollout, do_sample=False)
    base = generated(tiny_rollout)
    assert not torch.equal(base["responses"], greedy["responses"])  # a draw at temperature 1 is not greedy
    for setting in ("rollout.top_k=1", "rollout.top_p=0.01"):
        kept = generated(tiny_rollout, setting)
        assert torch.equal(kept["responses"], greedy["responses"]), setting
        mask = kept["response_mask"].bool()
        assert float(kept["rollout_logp"][mask].abs().max()) < 1e-6, setting  # one token kept: probability 1
    cold = generated(tiny_rollout, "rollout.temperature=0.5")
    mask = cold["response_mask"].bool()
    torch.testing.assert_close(cold["rollout_logp"][mask], trainer_logp(model, cold, 0.5)[mask], atol=1e-4, rtol=0)
    assert float((cold["rollout_logp"] - trainer_logp(model, cold, 1.0))[mask].abs().max()) > 0.05
    mask = base["response_mask"].bool()
    torch.testing.assert_close(base["rollout_logp"][mask], trainer_logp(model, base, 1.0)[mask], atol=1e-4, rtol=0)


# -- sandboxed code: run_sandboxed under SandboxLimits.from_config of the reward section ---------------

def sandboxed(code: str, *settings: str) -> Any:
    from engine.rewards.sandbox import SandboxJob, SandboxLimits, run_sandboxed

    if shutil.which("bwrap") is None:
        message = "bubblewrap (bwrap) is not installed: apt-get install bubblewrap to run the sandbox tests"
        if os.environ.get("RLFLOW_SANDBOX_TESTS") == "required":
            pytest.fail(message)
        pytest.skip(message)
    limits = SandboxLimits.from_config(load_config(None, list(settings)).reward)
    (result,) = run_sandboxed([SandboxJob(code, mode="exec", builtins=True)], limits)
    return result


@pytest.mark.effect_of("reward.sandbox.isolation", "reward.sandbox_memory_mb", "reward.sandbox_timeout_s")
def test_sandboxed_code_runs_under_the_reward_settings() -> None:
    """isolation: bwrap gives the code a PID namespace of its own (its PID 1 is the sandbox's Python),
    none runs it among the host's processes; the memory cap and the timeout are the configured ones."""
    pid = "import os; result = [os.getpid(), open('/proc/1/cmdline', 'rb').read().split(b'\\0')[0].decode()]"
    confined, unconfined = sandboxed(pid), sandboxed(pid, "reward.sandbox.isolation=none")
    assert confined.status == unconfined.status == "ok", (confined, unconfined)
    assert confined.value[0] < 10 and confined.value[1] == sys.executable, confined.value
    assert unconfined.value[0] > 10 and unconfined.value[1] != sys.executable, unconfined.value
    big = "x = bytearray(150 * 2**20); result = len(x)"
    assert sandboxed(big).status == "ok"
    capped = sandboxed(big, "reward.sandbox_memory_mb=128")
    assert (capped.status, capped.detail) == ("memory", "MemoryError"), capped
    slow = "import time; time.sleep(1); result = 1"
    assert sandboxed(slow).status == "ok"
    cut = sandboxed(slow, "reward.sandbox_timeout_s=0.3")
    assert cut.status == "timeout" and cut.elapsed_s < 0.9, cut


@pytest.mark.effect_of("placement.cpu_kernels")
def test_the_ranks_environment_follows_the_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment every worker and rank starts with (flows.train.worker_env) pins the kernels
    placement.cpu_kernels names: avx2's variables, none for native."""
    from engine.cpu_kernels import AVX2_ENV, has_avx2
    from flows.train import worker_env

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", *AVX2_ENV):
        monkeypatch.delenv(key, raising=False)
    native = worker_env(load_config(None, ["placement.cpu_kernels=native"]))
    assert not set(AVX2_ENV) & set(native), native
    if not has_avx2():
        with pytest.raises(ConfigError, match="this CPU has no AVX2"):
            worker_env(load_config(None, ["placement.cpu_kernels=avx2"]))
        return
    pinned = worker_env(load_config(None, ["placement.cpu_kernels=avx2"]))
    assert {key: pinned.get(key) for key in AVX2_ENV} == AVX2_ENV


# -- the update's gradient: PolicyWorker.gradients with the policy spec flows.plan builds -------------

V, PAD = 16, 0
# Three rows, a one-token prompt each, T = 3, responses of 3, 2 and 1 tokens.
PROMPTS = [[1], [5], [9]]
RESPONSES = [[2, 3, 4], [6, 7, PAD], [10, PAD, PAD]]
MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
# pi / pi_old per token: the 0.7s are below 1 - 0.2 (clipped where the advantage is negative) and above
# 1 - 0.4; pi_old / pi_rollout (the correction's weights) off 1.
RATIO = [[1.0, 0.7, 1.1], [0.7, 1.05, 1.0], [0.95, 1.0, 1.0]]
BEHAVIOUR = [[3.0, 0.3, 1.0], [1.0, 4.0, 1.0], [0.5, 1.0, 1.0]]
ADV = [[1.0, -2.0, 0.5], [-1.5, 1.0, 0.0], [2.0, 0.0, 0.0]]




def update_batch(table: torch.Tensor) -> Batch:
    responses, mask = torch.tensor(RESPONSES), torch.tensor(MASK)
    inputs = torch.tensor([p + r[:-1] for p, r in zip(PROMPTS, RESPONSES)])
    logp = torch.log_softmax(table[inputs], -1).gather(-1, responses[..., None])[..., 0]  # [B, T]
    old_logp = logp - torch.tensor(RATIO).log()
    attention = torch.cat([torch.ones(3, 1, dtype=torch.long), mask], dim=1)
    return Batch({"input_ids": torch.cat([torch.tensor(PROMPTS), responses], dim=1), "attention_mask": attention,
                  "responses": responses, "response_mask": mask, "old_logp": old_logp,
                  "rollout_logp": old_logp - torch.tensor(BEHAVIOUR).log(), "ref_logp": old_logp - 0.3,
                  "adv": torch.tensor(ADV)}, {})


def gradient(*settings: str) -> torch.Tensor:
    """The gradient of the bigram table an update with the settings would step with (one mini-batch)."""
    from engine.workers.policy import PolicyWorker
    from flows.plan import engine_spec

    cfg: RLConfig = load_config(None, ["actor.share_prompts=false", "rollout.max_new_tokens=3", *settings])
    spec = engine_spec(cfg, "t", "unused", "unused").policy
    worker = PolicyWorker(spec=spec.model_dump(), run_id="t", role="policy", rank=0, world_size=1, config_hash="t",
                          num_threads=torch.get_num_threads())
    worker.actor = Bigram(V)
    worker.optimizer = torch.optim.SGD(worker.actor.parameters(), lr=0.0)
    return worker.gradients(update_batch(worker.actor.table.detach()))["table"]


def rows_of(grad: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """The gradient of the table row that scores response token t of row b."""
    return grad[(PROMPTS[b] + RESPONSES[b])[t]]


@pytest.mark.effect_of("actor.clip_low", "actor.policy_loss", "actor.loss_agg_mode", "actor.entropy_coeff",
                       "actor.kl_loss_coef", "actor.rollout_correction.mode")
def test_the_update_gradient_follows_the_loss_settings() -> None:
    """Each loss setting, from the config through flows.plan.engine_spec into the policy rank's update:
    the clip range (a token with ratio 0.7 and a negative advantage gets no gradient at clip_low 0.2, one
    at 0.4), GSPO's sequence ratio, the aggregation, the entropy and KL terms (linear in their
    coefficients), and the rollout correction's weights."""
    base = gradient()
    assert float(base.norm()) > 1e-3
    assert float(rows_of(base, 0, 1).abs().max()) == 0 and float(rows_of(base, 1, 0).abs().max()) == 0  # clipped
    wider = gradient("actor.clip_low=0.4")
    assert float(rows_of(wider, 0, 1).abs().max()) > 1e-3 and float(rows_of(wider, 1, 0).abs().max()) > 1e-3
    assert torch.equal(rows_of(wider, 0, 0), rows_of(base, 0, 0))  # an unclipped token's is as before
    assert float((gradient("actor.policy_loss=gspo") - base).norm()) > 1e-3
    assert float((gradient("actor.loss_agg_mode=seq-mean-token-sum") - base).norm()) > 1e-3
    entropy = [gradient(f"actor.entropy_coeff={c}") for c in (0.0, 0.1, 0.2)]
    kl = [gradient("actor.use_kl_loss=true", f"actor.kl_loss_coef={c}") for c in (0.0, 0.1, 0.2)]
    for zero, one, two in (entropy, kl):  # the coefficient's term: linear in it
        assert float((one - zero).norm()) > 1e-3
        torch.testing.assert_close(two - zero, 2 * (one - zero), atol=1e-6, rtol=1e-4)
    corrected = gradient("actor.rollout_correction.mode=truncate")
    assert float((corrected - base).norm()) > 0.1 * float(base.norm())


# -- the room the engine asks for: check_fits on the spec flows.plan builds ---------------------------

@pytest.mark.effect_of("trainer.world_size", "placement.mode", "placement.cpus_per_rank")
def test_the_engines_pools_follow_the_placement_settings() -> None:
    """The ranks and CPUs the engine's worker groups take, as check_fits weighs them against a cluster
    of 4 CPUs: trainer.world_size ranks of placement.cpus_per_rank CPUs, plus the rollout pool with
    placement.mode=split."""
    from engine.engine import check_fits
    from flows.plan import engine_spec

    def fits(*settings: str) -> str:
        cfg = load_config(None, ["trainer.world_size=2", "placement.cpus_per_rank=2", *settings])
        try:
            check_fits(engine_spec(cfg, "t", "m", "t"), {"CPU": 4.0})
        except ConfigError as err:
            return str(err).split(":", 1)[1].split(",", 1)[0].strip()
        return "fits"

    assert fits() == "fits"
    assert fits("trainer.world_size=4") == "policy pool 4 x 2 = 8 CPUs"
    assert fits("placement.cpus_per_rank=3") == "policy pool 2 x 3 = 6 CPUs"
    assert fits("placement.mode=split") == "policy pool 2 x 2 + rollout pool 1 x 2 = 6 CPUs"


# -- the update's weights: PolicyWorker.setup and update_actor with the policy spec flows.plan builds ---

@pytest.fixture(scope="module")
def one_rank() -> Any:
    """A torch.distributed group of one, in this process: FSDP2 and the update's collectives run the
    code a one-rank engine runs, without Ray."""
    import torch.distributed as dist

    if dist.is_initialized():  # an earlier test of this worker process left one: a group of one serves
        assert dist.get_world_size() == 1, f"this process has a torch.distributed group of {dist.get_world_size()}"
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# One update as test_every_field's runs make it (2 prompts x 4 responses, micro- and mini-batches of 4, so
# two optimizer steps), applied twice: Adam's betas and the schedule act from the second step.
UPDATE = ("trainer.total_iterations=2", "data.train_batch_size=2", "rollout.n=4", "actor.mini_batch_size=4",
          "actor.micro_batch_size=4", "rollout.max_new_tokens=8", "actor.lr=1e-3")


def policy_rank(tiny_model_dir: Path, *settings: str) -> Any:
    """A PolicyWorker set up (models loaded and sharded, optimizer and schedule built) from the config
    with the settings, through flows.plan.engine_spec as a run builds its engine."""
    from engine.workers.policy import PolicyWorker
    from flows.plan import engine_spec

    cfg: RLConfig = load_config(None, [f"model.path={tiny_model_dir}", REWARD, *UPDATE, *settings])
    spec = engine_spec(cfg, "u", str(tiny_model_dir), str(tiny_model_dir)).policy
    worker = PolicyWorker(spec=spec.model_dump(), run_id="u", role="policy", rank=0, world_size=1,
                          config_hash="u", num_threads=torch.get_num_threads())
    worker.setup()
    return worker


@pytest.fixture(scope="module")
def rank_prompts(tiny_model_dir: Path) -> Batch:
    """2 prompts, each 4 times in a row."""
    from engine.models.loading import load_tokenizer
    from engine.models.tokens import encode_prompts

    enc = encode_prompts(load_tokenizer(str(tiny_model_dir)), [[{"role": "user", "content": "sort 3 1 2"}],
                                                               [{"role": "user", "content": "sort 9 7 8 5"}]])
    return Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}, {}).repeat_interleave(4)


@pytest.fixture(scope="module")
def update_inputs(one_rank: None, tiny_model_dir: Path, rank_prompts: Batch) -> Batch:
    """What iteration 1's update reads, made by a rank of the base config: 2 prompts x 4 sampled responses,
    their old log-probs, the reference's (the same weights at iteration 1: equal), advantages of both
    signs."""
    worker = policy_rank(tiny_model_dir)
    batch = worker.generate(rank_prompts, iteration=1, expected_version=0)
    logp = worker.compute_log_prob(batch, expected_version=0)
    mask = batch["response_mask"].float()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.5, 1.5, 0.25, -0.25])[:, None] * mask
    return batch.with_tensors(old_logp=logp["old_logp"], entropy=logp["entropy"], ref_logp=logp["old_logp"],
                              adv=adv)


def sha256(tensors: dict[str, torch.Tensor]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for name, value in sorted(tensors.items()):
        digest.update(name.encode() + value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def updated(tiny_model_dir: Path, batch: Batch, *settings: str) -> dict[str, str]:
    """The weights that train (sha256) and each update's metrics, after iterations 1 and 2 on `batch`."""
    worker = policy_rank(tiny_model_dir, *settings)
    metrics = [worker.update_actor(batch, iteration=k, expected_version=k - 1) for k in (1, 2)]
    return {"weights": sha256(worker.trainable_weights()), **{f"{k} {key}": f"{v:.9g}" for k, m in enumerate(metrics, 1)
                                             for key, v in sorted(m.items()) if not key.startswith("timing_s/")}}


# (the group's settings, the setting): the update with the setting differs from the group's own
UPDATE_EFFECTS: list[tuple[tuple[str, ...], str]] = [
    ((), "model.dtype=bfloat16"),
    ((), "actor.lr=3e-3"),
    ((), "actor.weight_decay=0.1"),
    ((), "actor.betas=[0.5,0.9]"),
    ((), "actor.warmup_steps=2"),
    ((), "actor.lr_schedule=cosine"),
    (("actor.lr_schedule=cosine",), "actor.min_lr_ratio=0.5"),
    ((), "actor.grad_clip=0.01"),
    ((), "actor.ppo_epochs=2"),
    ((), "actor.mini_batch_size=8"),
    ((), "actor.micro_batch_size=2"),
    ((), "actor.max_tokens_per_micro_batch=40"),
    ((), "actor.packed_sequences=true"),
    ((), "actor.mixed_precision=bf16"),
    ((), "actor.gradient_checkpointing=true"),  # the padded layout; its recomputation: the next test
    ((), "actor.lora.rank=4"),
    (("actor.lora.rank=4",), "actor.lora.alpha=8"),
    (("actor.lora.rank=4",), "actor.lora.dropout=0.1"),
    (("actor.lora.rank=4",), "actor.lora.target_modules=[q_proj]"),
    ((), "actor.clip_high=0.001"),
    ((), "actor.clip_ratio_c=1.001"),
    ((), "actor.use_kl_loss=true"),
    (("actor.use_kl_loss=true",), "actor.kl_loss_type=k1"),
    ((), "actor.share_prompts=false"),
]


@pytest.mark.effect_of("model.dtype", "actor.lr", "actor.weight_decay", "actor.betas", "actor.warmup_steps",
                       "actor.lr_schedule", "actor.min_lr_ratio", "actor.grad_clip", "actor.ppo_epochs",
                       "actor.mini_batch_size", "actor.micro_batch_size", "actor.max_tokens_per_micro_batch",
                       "actor.packed_sequences", "actor.mixed_precision", "actor.gradient_checkpointing",
                       "actor.lora.rank", "actor.lora.alpha", "actor.lora.dropout", "actor.lora.target_modules",
                       "actor.clip_high", "actor.clip_ratio_c", "actor.use_kl_loss", "actor.kl_loss_type",
                       "actor.share_prompts")
def test_the_update_follows_the_actor_settings(tiny_model_dir: Path, update_inputs: Batch) -> None:
    """Each setting, from the config through flows.plan.engine_spec into a policy rank's setup and two
    updates of the tiny model: the weights that train or the update's metrics differ from those of the
    same updates without it (for how the work is cut, micro-batches, packing, checkpointing, that is the
    last bits of the weights: the sums run in another order). The same settings twice give the same."""
    runs: dict[tuple[str, ...], dict[str, str]] = {}

    def run(*settings: str) -> dict[str, str]:
        if settings not in runs:
            runs[settings] = updated(tiny_model_dir, update_inputs, *settings)
        return runs[settings]

    assert run() == updated(tiny_model_dir, update_inputs)
    unchanged = []
    for group, setting in UPDATE_EFFECTS:
        if run(*group) == run(*group, setting):
            unchanged.append(setting)
    assert not unchanged, f"changed nothing the update computes: {unchanged}"


def layer_calls(tiny_model_dir: Path, batch: Batch, *settings: str) -> int:
    """How many times the first decoder layer's forward runs in one update."""
    worker = policy_rank(tiny_model_dir, *settings)
    layer = next(m for m in worker.actor.modules() if type(m).__name__.endswith("DecoderLayer"))
    calls = []
    layer.register_forward_pre_hook(lambda *_: calls.append(1))
    worker.update_actor(batch, iteration=1, expected_version=0)
    return len(calls)


@pytest.mark.effect_of("actor.gradient_checkpointing")
def test_gradient_checkpointing_recomputes_the_layers_in_the_backward(tiny_model_dir: Path,
                                                                      update_inputs: Batch) -> None:
    """actor.gradient_checkpointing: each decoder layer's forward runs again in the backward (its
    activations were not kept), so twice per micro-batch; once without. The padded layout in both (with
    checkpointing the prompts are not shared: test_the_update_follows_the_actor_settings sees that)."""
    once = layer_calls(tiny_model_dir, update_inputs, "actor.share_prompts=false")
    assert once == 2  # two micro-batches
    assert layer_calls(tiny_model_dir, update_inputs, "actor.share_prompts=false",
                       "actor.gradient_checkpointing=true") == 2 * once



@pytest.mark.effect_of("rollout.max_new_tokens", "rollout.micro_batch_size", "rollout.weights",
                       "rollout.log_prob_max_tokens_per_micro_batch")
def test_a_ranks_rollout_follows_the_rollout_settings(one_rank: None, tiny_model_dir: Path,
                                                      rank_prompts: Batch) -> None:
    """On a policy rank set up from the config: the responses' length bound; the generation's micro-batches
    (each with a sampling seed of its own, so other draws); a rollout copy that the sync fills (rather than
    generating from the actor itself, nothing to sync); the old log-probs' token budget per micro-batch."""
    def rolled_out(*settings: str) -> dict[str, Any]:
        worker = policy_rank(tiny_model_dir, *settings)
        batch = worker.generate(rank_prompts, iteration=1, expected_version=0)
        logp = worker.compute_log_prob(batch, expected_version=0)
        return {"width": batch["responses"].shape[1], "responses": sha256(batch.tensors),
                "old_logp micro-batches": logp.meta["micro_batches"],
                "sync MB": worker.sync_rollout_weights()["perf/weight_sync_mb"]}

    base = rolled_out()
    assert base["width"] == 8 and base["old_logp micro-batches"] == 2 and base["sync MB"] == 0
    assert rolled_out("rollout.max_new_tokens=6")["width"] == 6
    assert rolled_out("rollout.micro_batch_size=3")["responses"] != base["responses"]
    assert rolled_out("rollout.weights=copy")["sync MB"] > 0.01
    assert rolled_out("rollout.log_prob_max_tokens_per_micro_batch=40")["old_logp micro-batches"] > 2


# -- the advantages: the advantage stage's math with the run plan's algorithm section -----------------

@pytest.mark.effect_of("algorithm.norm_adv_by_std", "algorithm.kl_penalty")
def test_the_advantages_follow_the_algorithm_settings(open_plan: Any) -> None:
    """engine.advantage.compute_advantages (what the compute_advantages stage calls) with the algorithm
    section of a run opened with the settings: GRPO's advantages divided by the group's standard
    deviation or not; the KL in the reward estimated per token as k1 (log-ratio) or k3."""
    from engine.advantage import compute_advantages

    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    scores = torch.zeros(4, 3)
    scores[[0, 1, 2, 3], [2, 1, 0, 2]] = torch.tensor([1.0, 0.0, 0.5, 0.0])  # at each response's last token
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0], [-1.5, 0.0, 0.0], [-0.7, -0.1, -2.2]])
    batch = Batch({"response_mask": mask, "token_scores": scores, "group_id": torch.zeros(4, dtype=torch.long),
                   "old_logp": old_logp, "ref_logp": old_logp * 1.3 - 0.2}, {})

    def advantages(*settings: str) -> Batch:
        return compute_advantages(batch, open_plan(*settings).algorithm, 0.1)[0]

    base = advantages()
    unscaled = advantages("algorithm.norm_adv_by_std=false")
    std = float(torch.tensor([1.0, 0.0, 0.5, 0.0]).std())
    torch.testing.assert_close(unscaled["adv"] * mask, base["adv"] * mask * std, atol=1e-5, rtol=1e-4)
    k1 = advantages("algorithm.use_kl_in_reward=true")
    k3 = advantages("algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k3")
    ratio = (old_logp * 0.3 - 0.2) * mask  # log ref - log pi, per token
    torch.testing.assert_close(k1["token_rewards"], scores - 0.1 * (-ratio), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k3["token_rewards"], scores - 0.1 * (ratio.exp() - 1 - ratio) * mask,
                               atol=1e-6, rtol=1e-5)
