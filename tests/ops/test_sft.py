"""Supervised fine-tuning (`rlflow sft`, algorithm.objective=sft) and DPO through the real CLI, stack, Prefect deployment and
storage, on two ranks: the sort task's demonstrations (each prompt with its reference answer as the
assistant's turn), 4 iterations of 8 conversations, two optimizer steps each.

- The uninterrupted run: each iteration's `sft` buffer holds exactly the sampler's conversations as
  training rows (the assistant's tokens in response_mask), readable with pandas; the validation loss falls (iteration 4 against 0).
- A deployed run whose update of iteration 2 fails past its retries is retried through the call the
  UI's Retry button makes: the retry reuses the iteration's conversations (`Cached`, buffer untouched)
  and, two iterations a flow run, goes on through iteration 3. The lineage then goes on from the CLI, is
  killed (flow and engine) right after iteration 4's update, and resumed: the uninterrupted run's weights, bit for bit, and no complete buffer ever rewritten.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from tasks.stages import RETRIES
from tests.ops.conftest import NEVER, serving, subflow_runs, task_states, trigger, wait_for
from tests.ops.test_async import assert_equal_weights
from tests.ops.test_dynamic_sampling import buffer
from tests.ops.test_dynamic_sampling import weights as shared_weights
from tests.ops.test_faults import buffers
from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ITERATIONS = 4
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_sft.yaml"
DPO_CONFIG = CONFIG.with_name("tiny_dpo.yaml")
FAULT = ("debug.fail_stage=update_policy", f"debug.fail_times={RETRIES + 1}", "debug.fail_iteration=2")


def args(model: Path, root: Path, *extra: str) -> list[str]:
    """configs/tiny_sft.yaml (`rlflow sft`'s default config), smaller."""
    return [f"model.path={model}", f"storage.root={root}", "algorithm.objective=sft",
            f"trainer.total_iterations={ITERATIONS}", "trainer.world_size=2", "trainer.save_every=1",
            "trainer.val_every=2", "data.task=sort", "data.train_size=64", "data.val_size=16", "data.train_batch_size=8",
            "data.max_length=64", "actor.mini_batch_size=4", "actor.micro_batch_size=2", "actor.lr=1e-3", *extra]


def metrics(root: Path, run_id: str) -> list[dict]:
    return [json.loads((root / run_id / "metrics" / f"iter_{i:06d}.json").read_text()) for i in range(ITERATIONS + 1)]


def weights(root: Path, run_id: str) -> dict:
    return shared_weights(root, run_id, ITERATIONS)


@pytest.fixture(scope="module")
def reference(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("sft-reference")
    proc = warm_cli("sft", *args(tiny_model_dir, root, "trainer.run_id=sft-ref"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"root": root, "weights": weights(root, "sft-ref"), "metrics": metrics(root, "sft-ref")}


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
    losses = [m["val/loss"] for m in reference["metrics"] if "val/loss" in m]
    # iterations 0, 2 and 4 (measured: 1.249, 1.298, 1.200: Adam's first steps on 8 conversations are noisy)
    assert len(losses) == 3 and losses[2] < losses[0] - 0.02, losses
    assert run["config"]["algorithm"]["objective"] == "sft"


def test_retry_then_kill_and_resume_of_an_sft_run(cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path,
                                                  prefect: Any, reference: dict) -> None:
    from prefect.states import AwaitingRetry

    name, root = "sft-retry", tmp_path / "runs"
    proc = warm_cli("deploy", str(CONFIG), *args(tiny_model_dir, root, "trainer.iterations_per_run=2", *FAULT),
                    "--name", name,
                    "--cron", NEVER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        with serving(cli, [name], tmp_path / "serve-home") as server:
            run = wait_for(prefect, trigger(prefect, name).id, lambda s: s.is_final(), server)
            assert run.state.is_failed(), f"{run.state.name}: {run.state.message}\n{server.tail()}"
            conversations = root / name / "buffers" / "iter_000002" / "sft.parquet"
            before = (conversations.stat().st_mtime_ns, conversations.read_bytes())
            assert prefect.set_flow_run_state(run.id, AwaitingRetry(message="retried")).status.value == "ACCEPT"
            done = wait_for(prefect, run.id, lambda s: s.is_final() and s.name != "AwaitingRetry", server)
            assert done.state.is_completed(), f"{done.state.name}: {done.state.message}\n{server.tail()}"
        retried = subflow_runs(prefect, run.id)[-1]
        iteration = [r for r in subflow_runs(prefect, retried.id) if r.name == "iter-000002"]
        states = task_states(prefect, iteration[0].id)
        assert states.get("load_conversations") == "Cached" and states.get("update_policy") == "Completed", states
        assert (conversations.stat().st_mtime_ns, conversations.read_bytes()) == before
        kept = buffers(root, name)
        killed = cli("train", "--resume", name, f"storage.root={root}", "debug.kill_flow_after=update_policy",
                     "debug.kill_iteration=4")
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    finally:
        cli("engine", "stop", name)
    again = warm_cli("train", "--resume", name, f"storage.root={root}")
    assert again.returncode == 0, again.stderr[-4000:]
    after = buffers(root, name)
    assert all(after[k] == v for k, v in kept.items())  # nothing complete was written again
    assert_equal_weights(weights(root, name), reference["weights"])
    assert [m.get("actor/sft_loss") for m in metrics(root, name)] == [m.get("actor/sft_loss") for m in reference["metrics"]]


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
