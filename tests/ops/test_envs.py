"""An environment (rollout.env) and an agent (rollout.agent) through the real CLI, stack and storage:
GuessNumber (with some episodes hanging past their deadline) played by the quickly built tiny model, two
iterations of GRPO; the agent is the same game written against the openai client.

- The rollout buffer keeps every episode's turns, readable with pandas; the hints are holes in the
  response mask; the reward stage's score is the environment's, and its token scores put each step's
  reward at its turn's last token; hung episodes are errors with the configured reward, each with its
  reason in the buffer and counted in the metrics, and the iteration goes on.
- The environment's run and the agent's: a stage failing past its retries, then the resume killed after
  an update (flow and engine), then resumed again: the uninterrupted environment run's weights bit for
  bit (the agent's, its rows too: its calls made the environment's rows, token for token), every
  complete buffer kept (the episodes' rollout is reused, not played again).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from tests.ops.test_async import assert_equal_weights, metrics_done
from tests.ops.test_credentials import paged
from tests.ops.test_dynamic_sampling import buffer
from tests.ops.test_dynamic_sampling import metrics as shared_metrics
from tests.ops.test_dynamic_sampling import weights as shared_weights
from tests.ops.test_faults import buffers
from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ENVS = Path(__file__).resolve().parents[1] / "pipeline" / "envs.py"
KILL_AFTER_UPDATE_2 = ("debug.kill_flow_after=update_policy", "debug.kill_iteration=2")
ITERATIONS, N, PROMPTS = 2, 4, 4
AGENTS = ENVS.parent / "agents.py"
SETTINGS = ("rollout.multi_turn.max_turns=3", "rollout.multi_turn.env_step_timeout_s=1",
            "rollout.multi_turn.env_error_reward=-0.5")
ENV = ("rollout.multi_turn.enable=true", f"rollout.env={ENVS}:GuessOrHang", *SETTINGS)
AGENT = ("rollout.multi_turn.enable=true", f"rollout.agent={AGENTS}:guess_or_hang", *SETTINGS)


def args(model: Path, root: Path, run_id: str, *extra: str, side: tuple[str, ...] = ENV) -> list[str]:
    return [f"model.path={model}", f"storage.root={root}", f"trainer.run_id={run_id}",
            f"trainer.total_iterations={ITERATIONS}", "trainer.save_every=1", "trainer.val_every=0",
            f"data.train_batch_size={PROMPTS}", f"rollout.n={N}", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
            "data.train_size=64", "data.val_size=8", "rollout.max_new_tokens=48", "actor.lr=1e-3",
            "data.max_prompt_length=32", *side, *extra]


def metrics(root: Path, run_id: str) -> list[dict]:
    return shared_metrics(root, run_id, ITERATIONS)


def weights(root: Path, run_id: str) -> dict:
    return shared_weights(root, run_id, ITERATIONS)


@pytest.fixture(scope="module")
def reference(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("env-reference")
    proc = warm_cli("train", *args(tiny_model_dir, root, "env-ref"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"root": root, "weights": weights(root, "env-ref"), "metrics": metrics(root, "env-ref"),
            "logs": proc.stdout + proc.stderr}


def test_episodes_are_in_the_buffers_and_their_rewards_are_the_environments(reference: dict, tiny_model_dir: Path,
                                                                           prefect: Any) -> None:
    """`prefect`: a client of the stack's API (tests/ops/conftest.py), for the episodes' artifact and logs."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, LogFilter, LogFilterLevel
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    root, hung = reference["root"], 0
    for i, line in enumerate(reference["metrics"], start=1):
        rollout, reward = buffer(root, "env-ref", i, "rollout"), buffer(root, "env-ref", i, "reward")
        frame = pd.read_parquet(root / "env-ref" / "buffers" / f"iter_{i:06d}" / "rollout.parquet")
        assert len(rollout) == PROMPTS * N and rollout["prompt_ids"].shape[1] == 32
        for r in range(len(rollout)):
            turns = json.loads(frame["turns"][r])
            assert json.loads(frame["env_prompt"][r]) == [{"role": "user", "content": "guess 1-16"}]
            mask = rollout["response_mask"][r].bool()
            real = rollout["attention_mask"][r, 32:].bool()
            hints = [t for t in turns if t["role"] == "user"]
            # the hints, as the model read them, are exactly the holes
            assert tok.decode(rollout["responses"][r][real & ~mask].tolist()) == "".join(t["text"] for t in hints)
            assert all(t["content"] in ("higher", "lower", "say a number") for t in hints)
            steps = [t for t in turns if t["role"] == "assistant"]
            if frame["env_error"][r]:
                hung += 1
                assert frame["env_error"][r] == "GuessOrHang.step ran over its 1 s (rollout.multi_turn.env_step_timeout_s)"
                assert steps[-1]["error"] == frame["env_error"][r] and float(rollout["env_reward"][r]) == -0.5
            else:
                assert float(rollout["env_reward"][r]) == sum(t.get("reward", 0.0) for t in steps)
        # the reward stage's score is the environment's; its token scores are the episodes'
        assert torch.equal(reward["score"], rollout["env_reward"])
        assert torch.equal(reward["token_scores"], rollout["env_token_rewards"])
        several = (reward["token_scores"] != 0).sum(dim=1) > 1  # a reward at more than the last turn
        assert bool(several.any()), "no episode had two steps: the per-step rewards were not exercised"
        assert line["env/errors"] == float(rollout["env_errors"].sum())
        assert line["env/reward/mean"] == pytest.approx(float(rollout["env_reward"].mean()))
    assert hung > 0, "no episode hung: the deadline was not exercised"
    # the last iteration's episodes, as the UI's iteration page shows them
    tables = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["env-ref-episodes"])))
    assert len(tables) == ITERATIONS  # one an iteration, each on its own flow run
    table = max(tables, key=lambda t: t.created)
    rows, frame = json.loads(table.data), pd.read_parquet(root / "env-ref" / "buffers" / f"iter_{ITERATIONS:06d}" / "rollout.parquet")
    assert [r["reward"] for r in rows] == frame["env_reward"].tolist()
    assert [r["error"] for r in rows] == frame["env_error"].tolist()
    assert [r["steps"] for r in rows] == frame["env_steps"].tolist()
    assert all(r["turns"].startswith("assistant: ") for r in rows)
    # and the task logs name the hung episodes
    warnings = LogFilter(level=LogFilterLevel(ge_=30))
    logs = " ".join(log.message for log in paged(lambda n: prefect.read_logs(log_filter=warnings, limit=200, offset=n)))
    assert "ended as an error: GuessOrHang.step ran over its 1 s" in logs


@pytest.mark.parametrize("side", [ENV, AGENT], ids=["env", "agent"])
def test_failed_then_killed_run_resumes_like_the_uninterrupted_one(
        side: tuple[str, ...], cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path, reference: dict
) -> None:
    """compute_advantages of iteration 2 fails past its retries; run again, the run reuses iteration 2's
    episodes and is killed, flow and engine, right after that iteration's update; the second resume ends
    with the uninterrupted environment run's weights. No complete buffer is ever rewritten."""
    failed = cli("train", *args(tiny_model_dir, tmp_path, "env-fail", "debug.fail_stage=compute_advantages",
                                "debug.fail_times=3", "trainer.stage_retry_delays_s=[0,0]", "debug.fail_iteration=2", side=side))
    assert failed.returncode != 0 and failed.returncode != -signal.SIGKILL, failed.stderr[-3000:]
    assert metrics_done(tmp_path, "env-fail") == [1]
    before = buffers(tmp_path, "env-fail")
    assert any("iter_000002/rollout" in k for k in before)
    # the environment or agent is code: given again on every resume (run.json never chooses it)
    killed = cli("train", "--resume", "env-fail", f"storage.root={tmp_path}", *side[:2], *KILL_AFTER_UPDATE_2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert warm_cli("engine", "stop", "env-fail").returncode == 0
    after_kill = buffers(tmp_path, "env-fail")
    assert all(after_kill[k] == v for k, v in before.items())  # the failed iteration's episodes were reused
    again = warm_cli("train", "--resume", "env-fail", f"storage.root={tmp_path}", *side[:2])
    assert again.returncode == 0, again.stderr[-4000:]
    after = buffers(tmp_path, "env-fail")
    assert all(after[k] == v for k, v in after_kill.items())
    assert_equal_weights(weights(tmp_path, "env-fail"), reference["weights"])
    assert [m["env/reward/mean"] for m in metrics(tmp_path, "env-fail")] == \
        [m["env/reward/mean"] for m in reference["metrics"]]
    # the same rows, hung episodes included (the agent's episodes are the environment's)
    for i in range(1, ITERATIONS + 1):
        mine, env = buffer(tmp_path, "env-fail", i, "rollout"), buffer(reference["root"], "env-ref", i, "rollout")
        for key in ("input_ids", "response_mask", "rollout_logp", "env_reward", "env_errors", "env_steps"):
            assert torch.equal(mine[key], env[key]), key
