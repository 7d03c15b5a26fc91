"""Multi-turn rollouts with tools through the real CLI, stack and storage: the tiny model warm-started on
four-digit sums, half of its demonstrations calling the calculator tool (hermes format), trained with
rollout.multi_turn on (engine.rollout.builtin_tools:calculator).

- The rollout buffer keeps every turn (readable with pandas); the observation tokens are holes in
  `response_mask` (no loss, no KL) but real tokens for attention; their rollout log-probs are 0; the
  observation of each call is the calculator's answer to the expression the model wrote.
- A tool that breaks gives error observations, never a failed rollout.
- rollout.name=vllm (a vLLM engine in each policy rank), with dynamic sampling and validation on in the
  same run: tool calls answered, observations as holes with rollout log-probs of 0, kept groups that
  differ. A stage failing past its retries: run again, the rollout is reused; that resume killed after
  an update, engine too, and resumed again: the uninterrupted vLLM run's weights bit for bit, every
  complete buffer kept.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pandas as pd
import pytest
import torch

from engine.batch import Batch
from engine.rollout.builtin_tools import calculator
from engine.rollout.tools import parse_tool_call
from tests.ops.test_async import assert_equal_weights, metrics_done
from tests.ops.test_faults import buffers
from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Given to the first resume (faults are not part of the config hash: the run keeps its engine and stages).
KILL_AFTER_UPDATE_2 = ("debug.kill_flow_after=update_policy", "debug.kill_iteration=2")
ITERATIONS, N, PROMPTS = 2, 4, 4
SFT_STEPS = 60  # enough for tool calls, most of them well formed (150 steps took 130 s more, 2026-12-02)
# code: given again on every resume (with the switch its check needs)
TOOL = ("rollout.multi_turn.enable=true", "rollout.multi_turn.tools=engine.rollout.builtin_tools:calculator")
TOOLS = Path(__file__).resolve().parents[1] / "pipeline" / "tools.py"


@pytest.fixture(scope="session")
def calc_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.demo.tiny import build_tiny

    out = tmp_path_factory.mktemp("calc") / "model"
    build_tiny(out, task="calc", seed=0, steps=SFT_STEPS)
    return out


def args(model: Path, root: Path, run_id: str, *extra: str) -> list[str]:
    return [f"model.path={model}", f"storage.root={root}", f"trainer.run_id={run_id}", "data.task=calc",
            f"trainer.total_iterations={ITERATIONS}", "trainer.save_every=1", "trainer.val_every=0",
            f"data.train_batch_size={PROMPTS}", f"rollout.n={N}", "actor.mini_batch_size=16", "actor.micro_batch_size=8",
            "data.train_size=64", "data.val_size=8", "rollout.max_new_tokens=144", "actor.lr=1e-4",
            "actor.use_kl_loss=true", *TOOL, *extra]


def buffer(root: Path, run_id: str, iteration: int, name: str) -> Batch:
    return Batch.from_parquet(str(root / run_id / "buffers" / f"iter_{iteration:06d}" / f"{name}.parquet"))


def weights(root: Path, run_id: str) -> dict:
    from safetensors.torch import load_file

    return load_file(root / run_id / "export" / f"step_{ITERATIONS:06d}" / "model.safetensors")


def test_turns_observations_and_masks(vllm_reference: dict, calc_model_dir: Path) -> None:
    """On the vLLM run's buffers (the turns are engine.rollout.multi_turn's whatever the backend; the hf backend's
    multi-turn rollouts are the broken-tool run's below)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(calc_model_dir)
    root = vllm_reference["root"]
    calls = answered = 0
    for i in range(1, ITERATIONS + 1):
        rollout = buffer(root, "vllm-ref", i, "rollout")
        frame = pd.read_parquet(root / "vllm-ref" / "buffers" / f"iter_{i:06d}" / "rollout.parquet")
        p = rollout["prompt_ids"].shape[1]
        for r in range(len(rollout)):
            turns = json.loads(frame["turns"][r])
            mask, real = rollout["response_mask"][r], rollout["attention_mask"][r, p:]
            holes = (real.bool() & ~mask.bool())
            observations = [t["content"] for t in turns if t["role"] == "tool"]
            assert int(rollout["tool_calls"][r]) == len(observations)
            # the holes hold exactly the observations, in their wrapping; no loss and no behaviour log-prob there
            hole_text = tokenizer.decode(rollout["responses"][r][holes].tolist())
            tool_turns = [t for t in turns if t["role"] == "tool"]
            assert hole_text == "".join(t["text"] for t in tool_turns)
            for t in tool_turns:  # the format's wrapping, cut only by the length limit
                assert f"\n<tool_response>\n{t['content']}\n</tool_response>\n".startswith(t["text"])
            assert bool((rollout["rollout_logp"][r][holes] == 0).all())
            # each observation is the calculator's answer to what the model wrote; a call the model wrote
            # malformed (it does, now and then) is answered with an error observation
            for turn, observation in zip([t for t in turns if t["role"] == "assistant"], observations):
                call = parse_tool_call(turn["content"], "hermes")
                if isinstance(call, str):
                    assert observation.startswith("error: "), (turn["content"], observation)
                elif not observation.startswith("error:"):
                    assert call is not None and observation == calculator(**call.arguments)
                    answered += 1
            calls += len(observations)
        adv = buffer(root, "vllm-ref", i, "advantage")
        assert bool((adv["adv"][~adv["response_mask"].bool()] == 0).all())  # no advantage on a hole
    assert calls > 0, "the warm-started model made no tool call: the test checks nothing"
    assert answered > 0, "no call was answered by the calculator: only the error path was checked"


@pytest.mark.effect_of("rollout.multi_turn.tools")
def test_a_broken_tool_gives_error_observations(warm_cli: WarmCli, calc_model_dir: Path, tmp_path: Path) -> None:
    """The tool named calculator raises on every call: the run completes, every call got an error."""
    proc = warm_cli("train", *args(calc_model_dir, tmp_path, "mt-broken", "trainer.total_iterations=1",
                              f"rollout.multi_turn.tools={TOOLS}:broken_calculator"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rollout = buffer(tmp_path, "mt-broken", 1, "rollout")
    assert int(rollout["tool_calls"].sum()) > 0
    assert torch.equal(rollout["tool_errors"], rollout["tool_calls"])
    turns = [t for row in rollout["turns"] for t in json.loads(row) if t["role"] == "tool"]
    assert all(t["content"].startswith("error: ") for t in turns)  # a malformed call's error, or the tool's
    assert "error: calculator failed: RuntimeError: the tool broke" in [t["content"] for t in turns]


# -- rollout.name=vllm: the same tool-use model, a vLLM engine in the policy rank ---------------------------
# One rank: what these runs claim (tools, dynamic sampling, validation, Retry and resume on vLLM) does not
# depend on the number of ranks, and each rank starts an engine of its own; vLLM engines in 2 sharded ranks,
# and the weight sync into each, are tests/engine/test_vllm_engine.py's.
VLLM = ("rollout.name=vllm", "rollout.vllm.kv_cache_gib=0.25", "trainer.world_size=1")


def vllm_args(model: Path, root: Path, run_id: str, *extra: str) -> list[str]:
    """The run above on vLLM, with DAPO's dynamic sampling and validation every iteration."""
    return args(model, root, run_id, "trainer.val_every=1", "algorithm.filter_groups=true",
                "algorithm.max_num_gen_batches=2", *VLLM, *extra)


@pytest.fixture(scope="module")
def vllm_reference(warm_cli: WarmCli, calc_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("vllm-reference")
    proc = warm_cli("train", *vllm_args(calc_model_dir, root, "vllm-ref"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads((root / "vllm-ref" / "metrics" / f"iter_{i:06d}.json").read_text())
             for i in range(1, ITERATIONS + 1)]
    return {"root": root, "weights": weights(root, "vllm-ref"), "metrics": lines}


def test_tools_dynamic_sampling_and_validation_with_vllm(vllm_reference: dict, calc_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(calc_model_dir)
    root, calls = vllm_reference["root"], 0
    for i, line in enumerate(vllm_reference["metrics"], start=1):
        assert "val/score/mean" in line  # validated every iteration, greedily, by the engines
        rollout, reward = buffer(root, "vllm-ref", i, "rollout"), buffer(root, "vllm-ref", i, "reward")
        p = rollout["prompt_ids"].shape[1]
        holes = rollout["attention_mask"][:, p:].bool() & ~rollout["response_mask"].bool()
        assert bool((rollout["rollout_logp"][holes] == 0).all())
        assert bool((rollout["rollout_logp"][rollout["response_mask"].bool()] < 0).any())
        for r in range(len(rollout)):
            if int(rollout["tool_calls"][r]):
                text = tokenizer.decode(rollout["responses"][r][holes[r]].tolist())
                assert text.startswith("\n<tool_response>\n"), text  # the observation is in the hole
                calls += int(rollout["tool_calls"][r])
        kept = int(line["sampling/groups_kept"])
        varied = reward["score"].view(-1, N).std(dim=1) > 0
        assert varied.tolist()[:kept] == [True] * kept
    assert calls > 0, "the model made no tool call under vLLM: the test checks nothing"


def test_failed_then_killed_vllm_run_resumes_like_the_uninterrupted_one(
        cli: Cli, warm_cli: WarmCli, calc_model_dir: Path, tmp_path: Path, vllm_reference: dict) -> None:
    """One run carries both faults. compute_advantages of iteration 2 fails past its retries (iteration 1
    committed); run again, the multi-turn rollout of iteration 2 is reused and the flow process is killed
    after its update, engine too; the second resume restores step 1 on a new engine (new vLLM engines in
    its ranks) and ends with the uninterrupted vLLM run's weights. No complete buffer is ever rewritten.
    (The resume path is the rollout engine's business only through the weights it is given: the same
    faults on the hf rollout are tests/ops/test_async.py's and tests/ops/test_faults.py's.)"""
    failed = cli("train", *vllm_args(calc_model_dir, tmp_path, "vllm-fail", "debug.fail_stage=compute_advantages",
                                     "debug.fail_times=3", "trainer.stage_retry_delays_s=[0,0]", "debug.fail_iteration=2"))
    assert failed.returncode != 0 and failed.returncode != -signal.SIGKILL, failed.stderr[-3000:]
    assert metrics_done(tmp_path, "vllm-fail") == [0, 1]  # 0: the validation before training
    before = buffers(tmp_path, "vllm-fail")
    killed = cli("train", "--resume", "vllm-fail", f"storage.root={tmp_path}", *TOOL, *KILL_AFTER_UPDATE_2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert warm_cli("engine", "stop", "vllm-fail").returncode == 0
    # killed by the resume, after iteration 2's update and before its commit
    assert (tmp_path / "vllm-fail" / "debug" / "killed_after_update_policy_000002").exists()
    assert metrics_done(tmp_path, "vllm-fail") == [0, 1]
    after_kill = buffers(tmp_path, "vllm-fail")
    assert all(after_kill[k] == v for k, v in before.items())  # the failed iteration's rollout was reused
    again = warm_cli("train", "--resume", "vllm-fail", f"storage.root={tmp_path}", *TOOL)  # a process new to the run
    assert again.returncode == 0, again.stderr[-4000:]
    assert "restored checkpoint step 1" in again.stdout + again.stderr
    after = buffers(tmp_path, "vllm-fail")
    assert all(after[k] == v for k, v in after_kill.items())  # every complete buffer kept, none rewritten
    assert_equal_weights(weights(tmp_path, "vllm-fail"), vllm_reference["weights"])
