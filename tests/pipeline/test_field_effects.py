"""What a setting changes, at the place where it acts, from the config as `load_config` builds it: the
prompts a stage draws (tasks.context), the rollout's sampling (policy.generate_batch), the update's
gradient (PolicyWorker.gradients), the room the engine asks the cluster for (engine.check_fits). Each
test is marked `effect_of` with the fields it shows; tests/pipeline/test_every_field.py names it for them.

No Ray, no run: the tiny model's files, a local storage root in tmp_path, one process.
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
