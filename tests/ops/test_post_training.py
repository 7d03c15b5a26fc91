"""Post-training besides RL on the same machinery, through the real CLI, stack, Prefect deployment and
storage: supervised fine-tuning (`rlflow sft`) and DPO on two ranks, on-policy distillation and the chain
on one (that sharded equals one process is tests/engine/test_gradients.py's claim).

- SFT on the sort task's demonstrations (each prompt with its reference answer as the assistant's turn),
  4 iterations of 8 conversations, two optimizer steps each: each iteration's `sft` buffer holds exactly
  the sampler's conversations as training rows (the assistant's tokens in response_mask), readable with
  pandas; the validation loss falls (iteration 4 against 0).
- Distillation: the tiny model as the student, the SFT run's export as the teacher (the same tokenizer):
  the teacher's buffer holds the teacher model's own log-probs of the sampled tokens, and each token's
  advantage is its log-ratio, teacher minus student.
- For SFT and for distillation at once, a deployed run whose update of iteration 2 fails past its retries
  is retried through the call the UI's Retry button makes: the retry reuses the iteration's finished
  stages (`Cached`, buffers untouched), goes on, and its flow process is killed right after iteration 4's
  update. With the engine it left stopped, `rlflow train --resume` ends with the uninterrupted run's
  weights, bit for bit, and no complete buffer ever rewritten.
- DPO (configs/tiny_dpo.yaml) with LoRA adapters, two iterations: the reference's log-probs of both
  responses of every pair are the base model's (the actor with its adapters off), iteration 1's loss is
  log 2 (the policy is its reference), and on held-out pairs the implicit reward margin grows from 0.
- A chained deployment (`rlflow deploy SFT_CONFIG --then RL_CONFIG`) run two nights: each night an SFT
  run on the data file as it is then, then an RL run from its checkpoint, each its own flow run; the
  second night's SFT run starts from the first night's RL weights, and every run.json names its parent.

One `rlflow serve` serves the module's three deployments.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from tests.ops.conftest import NEVER, run_args, serving, subflow_runs, task_states, trigger, wait_for
from tests.ops.test_async import assert_equal_weights, metrics_done
from tests.ops.test_dynamic_sampling import buffer
from tests.ops.test_dynamic_sampling import weights as shared_weights
from tests.ops.test_faults import buffers
from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ITERATIONS = 4
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_sft.yaml"
DPO_CONFIG = CONFIG.with_name("tiny_dpo.yaml")
DISTILL_CONFIG = CONFIG.with_name("tiny_distill.yaml")
FAULT = ("debug.fail_stage=update_policy", "debug.fail_times=3", "debug.fail_iteration=2",
         "trainer.stage_retry_delays_s=[0,0]")


def args(model: Path, root: Path, *extra: str) -> list[str]:
    """configs/tiny_sft.yaml (`rlflow sft`'s default config), smaller."""
    return [f"model.path={model}", f"storage.root={root}", "algorithm.objective=sft",
            f"trainer.total_iterations={ITERATIONS}", "trainer.world_size=2", "trainer.save_every=1",
            "trainer.val_every=2", "data.task=sort", "data.train_size=64", "data.val_size=16", "data.train_batch_size=8",
            "data.max_length=64", "actor.mini_batch_size=4", "actor.micro_batch_size=2", "actor.lr=1e-3", *extra]


def metrics(root: Path, run_id: str) -> dict[int, dict]:
    """Iteration -> its metrics line (0: the validation before training, where there is one)."""
    found = {i: root / run_id / "metrics" / f"iter_{i:06d}.json" for i in range(ITERATIONS + 1)}
    return {i: json.loads(path.read_text()) for i, path in found.items() if path.exists()}


def weights(root: Path, run_id: str) -> dict:
    return shared_weights(root, run_id, ITERATIONS)


@pytest.fixture(scope="module")
def reference(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("sft-reference")
    proc = warm_cli("sft", *args(tiny_model_dir, root, "trainer.run_id=sft-ref"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"root": root, "weights": weights(root, "sft-ref"), "metrics": metrics(root, "sft-ref")}


@pytest.mark.effect_of("algorithm.objective")
def test_the_conversations_are_the_samplers_and_the_validation_loss_falls(reference: dict, tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    from engine.data.conversations import demonstrations, load_conversations, sft_batch
    from engine.data.prompts import write_rows_parquet
    from engine.data.sampler import PromptSampler
    from engine.demo.synthetic import make_rows, solution_text
    from engine.models.loading import load_tokenizer

    root = reference["root"]
    run = json.loads((root / "sft-ref" / "run.json").read_text())
    tok = load_tokenizer(str(tiny_model_dir))
    # the run's data, made here as the flow made it: the synthetic rows with their reference answers
    path = write_rows_parquet(demonstrations(make_rows("sort", 64, 0, "train"), solution_text), tmp_path / "sft.parquet")
    rows = load_conversations([str(path)], split="train", tokenizer=tok, max_length=64, truncation="drop")
    assert len(rows) == 64
    sampler = PromptSampler(len(rows), 8, 0, True)
    for i in range(1, ITERATIONS + 1):
        indices = sampler.next_indices()
        got = buffer(root, "sft-ref", i, "sft")
        want = sft_batch(tok, [rows[j] for j in indices], indices)
        for key in ("input_ids", "attention_mask", "responses", "response_mask", "row_index"):
            assert torch.equal(got[key], want[key]), (i, key)
        frame = pd.read_parquet(root / "sft-ref" / "buffers" / f"iter_{i:06d}" / "sft.parquet")
        assert frame["row_index"].tolist() == indices
        line = reference["metrics"][i]
        assert line["sft/trained_tokens"] == float(want["response_mask"].sum())
        assert line["actor/sft_loss"] > 0
    losses = [m["val/loss"] for m in reference["metrics"].values() if "val/loss" in m]
    # iterations 0, 2 and 4 (measured: 1.249, 1.298, 1.200: Adam's first steps on 8 conversations are noisy)
    assert len(losses) == 3 and losses[2] < losses[0] - 0.02, losses
    assert run["config"]["algorithm"]["objective"] == "sft"


def distill_args(model: Path, root: Path, teacher: Path, *extra: str) -> list[str]:
    """configs/tiny_distill.yaml, smaller: 8 prompts x 2 responses of 8 tokens an iteration, on one rank."""
    return [f"model.path={model}", f"storage.root={root}", f"teacher.path={teacher}",
            f"trainer.total_iterations={ITERATIONS}", "trainer.world_size=1", "trainer.save_every=1",
            "trainer.val_every=0", "data.train_size=64", "data.val_size=16", "data.train_batch_size=8", "rollout.n=2",
            "rollout.max_new_tokens=8", "actor.mini_batch_size=8", "actor.micro_batch_size=4", "actor.lr=1e-3",
            "rollout.val_do_sample=false", *extra]


@pytest.fixture(scope="module")
def distilled(warm_cli: WarmCli, tiny_model_dir: Path, reference: dict, tmp_path_factory: pytest.TempPathFactory
              ) -> dict:
    """An uninterrupted distillation run whose teacher is the SFT reference run's export."""
    root = tmp_path_factory.mktemp("distill-reference")
    teacher = reference["root"] / "sft-ref" / "export" / f"step_{ITERATIONS:06d}"
    proc = warm_cli("train", str(DISTILL_CONFIG), *distill_args(tiny_model_dir, root, teacher, "trainer.run_id=distill-ref"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"root": root, "teacher": teacher, "weights": weights(root, "distill-ref"),
            "metrics": metrics(root, "distill-ref")}


def test_distillation_scores_every_token_by_the_teacher(distilled: dict) -> None:
    from transformers import AutoModelForCausalLM

    from engine import algos
    from engine.workers.policy import response_logits

    teacher = AutoModelForCausalLM.from_pretrained(distilled["teacher"]).eval()
    root = distilled["root"]
    for i in range(1, ITERATIONS + 1):
        rollout, scored = buffer(root, "distill-ref", i, "rollout"), buffer(root, "distill-ref", i, "teacher_logprob")
        mask = rollout["response_mask"]
        with torch.no_grad():
            want = algos.logprobs_from_logits(response_logits(teacher, rollout, 1.0, "padded"), rollout["responses"])
        assert float((scored["teacher_logp"] - want)[mask.bool()].abs().max()) < 1e-5, i
        adv = buffer(root, "distill-ref", i, "advantage")["adv"]
        assert torch.equal(adv, (scored["teacher_logp"] - rollout["rollout_logp"]) * mask.float()), i
        line = distilled["metrics"][i]
        assert line["distill/reverse_kl"] == pytest.approx(-float(adv[mask.bool()].mean()), rel=1e-5)


RETRIED = {  # the objective's deployment, its buffer of iteration 2 that the retry must reuse, and its reused stages
    "sft": ("sft-retry", "sft.parquet", ("load_conversations",)),
    "distill": ("distill-retry", "rollout.parquet", ("generate_rollouts", "compute_teacher_logprobs", "score_rewards",
                                                     "compute_advantages")),
}
CHAIN = "chain-nightly"
# The deployed runs fail in iteration 2's update past its retries; their Retry goes on and its flow process is
# killed right after iteration 4's update (the machine dies): a crash, then the resume.
KILL = ("trainer.iterations_per_run=4", "debug.kill_flow_after=update_policy", "debug.kill_iteration=4")


@pytest.fixture(scope="module")
def served(cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path, reference: dict, distilled: dict,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The module's deployments (the two objectives' failing runs and the SFT -> RL chain), served by one
    `rlflow serve` until the module ends."""
    root = tmp_path_factory.mktemp("deployed")
    retried, data = root / "runs", root / "demos.parquet"
    deployed = {
        RETRIED["sft"][0]: [str(CONFIG), *args(tiny_model_dir, retried, *FAULT, *KILL)],
        RETRIED["distill"][0]: [str(DISTILL_CONFIG), *distill_args(tiny_model_dir, retried, distilled["teacher"], *FAULT,
                                                                  *KILL)],
    }
    _conversations(data, 0)
    chained = root / "chain"
    sft = [str(CONFIG), f"model.path={tiny_model_dir}", f"storage.root={chained}", f"data.train_files=[{data}]",
           "trainer.total_iterations=1", "trainer.world_size=1", "trainer.save_every=1", "trainer.val_every=0",
           "data.train_batch_size=8", "actor.mini_batch_size=8", "actor.micro_batch_size=8"]
    rl = run_args(tiny_model_dir, chained, "trainer.total_iterations=1")  # one iteration each: the lineage is the claim
    deployed[CHAIN] = [*sft, "--then", str(CONFIG.with_name("tiny_grpo.yaml")), *(x for a in rl for x in ("--then-set", a))]
    for name, argv in deployed.items():
        proc = warm_cli("deploy", *argv, "--name", name, "--cron", NEVER)
        assert proc.returncode == 0, proc.stderr[-3000:]
    with serving(cli, list(deployed), root / "serve-home") as server:  # each run stops its engine at its end
        yield {"server": server, "retried": retried, "chain": chained, "data": data,
               "references": {"sft": reference, "distill": distilled}}


def test_retry_then_kill_and_resume(served: dict[str, Any], warm_cli: WarmCli, prefect: Any) -> None:
    """Both objectives at once: each deployed run fails, is retried through the call the UI's Retry button
    makes (its finished stages `Cached`, their buffers untouched), goes on and is killed after iteration 4's
    update, and resumes from storage alone (its engine stopped) to the uninterrupted run's weights. Each
    run is retried as soon as it failed, and resumed as soon as it was killed, while the other goes on."""
    from prefect.states import AwaitingRetry

    server, root = served["server"], served["retried"]
    runs = {objective: trigger(prefect, name) for objective, (name, _, _) in RETRIED.items()}
    before = {}
    for objective, run in runs.items():
        name, kept_buffer, _ = RETRIED[objective]
        run = wait_for(prefect, run.id, lambda s: s.is_final(), server)
        assert run.state.is_failed(), f"{run.state.name}: {run.state.message}\n{server.tail()}"
        path = root / name / "buffers" / "iter_000002" / kept_buffer
        before[objective] = (path, path.stat().st_mtime_ns, path.read_bytes())
        assert prefect.set_flow_run_state(run.id, AwaitingRetry(message="retried")).status.value == "ACCEPT"
    loss = {"sft": "actor/sft_loss", "distill": "distill/reverse_kl"}
    for objective, run in runs.items():
        name, _, reused = RETRIED[objective]
        done = wait_for(prefect, run.id, lambda s: s.is_final() and s.name != "AwaitingRetry", server)
        assert done.state.is_crashed() and done.run_count == 2, f"{done.state.name}: {done.state.message}\n{server.tail()}"
        stopped = warm_cli("engine", "stop", name)  # what the killed flow left running: resume from storage
        assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
        retried = subflow_runs(prefect, run.id)[-1]
        iteration = [r for r in subflow_runs(prefect, retried.id) if r.name == "iter-000002"]
        states = task_states(prefect, iteration[0].id, (*reused, "update_policy"))
        assert {s: states.get(s) for s in reused} == dict.fromkeys(reused, "Cached"), states
        assert states.get("update_policy") == "Completed", states
        path, *kept = before[objective]
        assert [path.stat().st_mtime_ns, path.read_bytes()] == kept
        assert metrics_done(root, name)[-2:] == [2, 3], objective  # killed before iteration 4's metrics
        kept_buffers = buffers(root, name)
        again = warm_cli("train", "--resume", name, f"storage.root={root}")
        assert again.returncode == 0, again.stderr[-4000:]
        assert all(buffers(root, name)[k] == v for k, v in kept_buffers.items())  # nothing complete was written again
        ref = served["references"][objective]
        assert_equal_weights(weights(root, name), ref["weights"])
        mine = [metrics(root, name)[i].get(loss[objective]) for i in range(1, ITERATIONS + 1)]
        assert None not in mine and mine == [ref["metrics"][i].get(loss[objective]) for i in range(1, ITERATIONS + 1)]


def test_a_dpo_run_against_the_base_model_as_its_reference(warm_cli: WarmCli, tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    import math

    from transformers import AutoModelForCausalLM

    from engine import algos
    from engine.data.preferences import rejected_view
    from engine.workers.policy import response_logits

    root = tmp_path / "runs"
    proc = warm_cli("train", str(DPO_CONFIG), f"model.path={tiny_model_dir}", f"storage.root={root}",
                    "trainer.run_id=dpo", "trainer.total_iterations=2", "trainer.world_size=2", "trainer.val_every=2",
                    "data.train_size=64", "data.val_size=16", "data.train_batch_size=8", "actor.mini_batch_size=8",
                    "actor.micro_batch_size=2", "actor.lr=1e-3", "actor.lora.rank=4", "actor.lora.alpha=8")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads((root / "dpo" / "metrics" / f"iter_{i:06d}.json").read_text()) for i in range(3)]
    # one optimizer step an iteration, so iteration 1's loss is the base's: LoRA's B = 0, the policy is the reference
    assert lines[1]["actor/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    # held out: the implicit reward margin from 0 (measured 1e-8) to positive (0.0114), the loss from log 2 down
    assert abs(lines[0]["val/reward_margin"]) < 1e-5 and lines[2]["val/reward_margin"] > 0.005, lines
    assert lines[0]["val/dpo_loss"] == pytest.approx(math.log(2), abs=1e-5) and lines[2]["val/dpo_loss"] < 0.690, lines
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for i in (1, 2):
        pairs, ref = buffer(root, "dpo", i, "pairs"), buffer(root, "dpo", i, "ref_logprob")
        for side, column in ((pairs, "ref_logp"), (rejected_view(pairs), "rejected_ref_logp")):
            with torch.no_grad():
                want = algos.logprobs_from_logits(response_logits(base, side, 1.0, "padded"), side["responses"])
            mask = side["response_mask"].bool()
            assert float((ref[column] - want)[mask].abs().max()) < 1e-5, (i, column)
        frame = pd.read_parquet(root / "dpo" / "buffers" / f"iter_{i:06d}" / "pairs.parquet")
        assert len(frame) == 8 and "rejected_responses" in frame


def _conversations(path: Path, offset: int) -> Path:
    """SFT data: 16 sort conversations with their reference answers, the rows from `offset` on."""
    from engine.data.conversations import demonstrations
    from engine.data.prompts import write_rows_parquet
    from engine.demo.synthetic import make_rows, solution_text

    return write_rows_parquet(demonstrations(make_rows("sort", 16 + offset, 0, "train")[offset:], solution_text), path)


def test_a_chained_deployment_continues_its_lineage_the_next_night(served: dict[str, Any], prefect: Any) -> None:
    from safetensors.torch import load_file

    server, root = served["server"], served["chain"]
    nights = []
    for night in (1, 2):
        if night == 2:
            _conversations(served["data"], 16)  # the newest demonstrations: the second night trains on them
        run = wait_for(prefect, trigger(prefect, CHAIN).id, lambda s: s.is_final(), server)
        assert run.state.is_completed(), f"{run.state.name}: {run.state.message}\n{server.tail()}"
        stages = subflow_runs(prefect, run.id)  # the night's two train flow runs, SFT then RL
        assert [r.name.rsplit("-", 1)[1] for r in stages] == ["sft", "rl"], [r.name for r in stages]
        assert all(r.state.is_completed() for r in stages)
        nights.append([r.name for r in stages])
    info = {r: json.loads((root / r / "run.json").read_text()) for night in nights for r in night}
    (sft1, rl1), (sft2, rl2) = nights
    parents = {r: (i["parent"] or {}).get("run_id") for r, i in info.items()}
    assert parents == {sft1: None, rl1: sft1, sft2: rl1, rl2: sft2}, parents
    assert all((info[r]["parent"] or {}).get("step", 1) == 1 for r in info)
    # the second night's SFT started from the first night's RL weights, exactly
    start = load_file(Path(info[sft2]["parent"]["model_path"]) / "model.safetensors")
    assert_equal_weights(start, load_file(root / rl1 / "export" / "step_000001" / "model.safetensors"))
    # and trained on the data as it was that night
    first, second = (buffer(root, r, 1, "sft")["input_ids"] for r in (sft1, sft2))
    assert not torch.equal(first, second)
