"""Learned reward models: the tiny reward model's build, and runs scored by it through `rlflow train`
(the tiny policy on sort prompts, the reward model in its own pool or in the policy's ranks).

What is checked against what: the reward buffer's `rm_score` against the reward model run here, in
this process, on the rollout's own text through the reward model's own chat template; the buffer's
`score` against the declared weighting of rule and model; the run's engine (policy + reward model
pool) surviving its controller and a rank's death, to the uninterrupted run's weights bit for bit.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.batch import Batch
from engine.demo.tiny_rm import TinyRMReport, build_tiny_rm
from engine.rewards.reward_model import (
    RewardModelSpec,
    conversation_text,
    encode_conversations,
    load_reward_model,
    sequence_scores,
)
from tests.ops.test_faults import buffers
from tests.pipeline.rewards import digit_share
from tests.pipeline.test_algorithms import REWARD, Run, overrides, train
from tests.services import Cli, WarmCli

RM_STEPS = 60


@pytest.fixture(scope="session")
def tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TinyRMReport]:
    out = tmp_path_factory.mktemp("tiny-rm") / "rm"
    return out, build_tiny_rm(out, steps=RM_STEPS)


@pytest.fixture(scope="session")
def tiny_rm_dir(tiny_rm: tuple[Path, TinyRMReport]) -> Path:
    return tiny_rm[0]


def rm_args(rm: Path, *extra: str) -> tuple[str, ...]:
    return ("data.task=sort", f"reward.model.path={rm}", "reward.rule_weight=0.5", "reward.model.weight=2.0",
            "reward.model.micro_batch_size=5", *extra)


def direct_scores(rm: Path, prompts: list, responses: list[str]) -> torch.Tensor:
    """The reward model run here, unsharded: its tokenizer, its template, the last real token's score."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rm)
    model = load_reward_model(RewardModelSpec(path=str(rm)))
    texts = [conversation_text(tokenizer, p, r) for p, r in zip(prompts, responses)]
    assert all(t.startswith("Q: sort ") and "\nA: " in t for t in texts)  # the reward model's own template
    with torch.no_grad():
        return torch.cat([sequence_scores(model, *encode_conversations(tokenizer, texts[i:i + 7], 512))
                          for i in range(0, len(texts), 7)])


def assert_scored_by_the_model(run: Run, rm: Path) -> None:
    from engine.demo.synthetic import make_rows

    rows = make_rows("sort", 64, 0, split="train")
    for i in range(1, run.iterations + 1):
        rollout, reward = run.buffer(i, "rollout"), run.buffer(i, "reward")
        texts = rollout["response_text"]
        prompts = [rows[r]["prompt"] for r in rollout["row_index"].tolist()]
        assert torch.allclose(reward["rm_score"], direct_scores(rm, prompts, texts), atol=1e-5)
        rule = [digit_share("sort", t, None) for t in texts]  # the rule of these runs (tests/pipeline/rewards.py)
        assert reward["rule_score"].tolist() == pytest.approx(rule)
        assert torch.allclose(reward["score"], 0.5 * reward["rule_score"] + 2.0 * reward["rm_score"], atol=1e-6)
        metrics = run.metrics(i)
        assert metrics["reward/rm/mean"] == pytest.approx(float(reward["rm_score"].mean()), abs=1e-6)
        assert metrics["reward/rule/mean"] == pytest.approx(float(reward["rule_score"].mean()), abs=1e-6)


def test_the_tiny_reward_model_is_deterministic_and_ranks_held_out_pairs(tiny_rm: tuple[Path, TinyRMReport],
                                                                        tmp_path: Path) -> None:
    """The build gives the same bytes twice (two short builds: a second full one would only repeat the
    first 60 steps' cost), and the full build ranks held-out pairs."""
    _, report = tiny_rm
    assert report.steps == RM_STEPS and report.held_out_pair_accuracy > 0.7, report
    builds = [tmp_path / name for name in ("once", "again")]
    for out in builds:
        build_tiny_rm(out, steps=4)
    first, second = (out / "model.safetensors" for out in builds)
    assert first.read_bytes() == second.read_bytes()


@pytest.mark.integration
@pytest.mark.slow
def test_a_causal_lm_is_refused_as_a_reward_model(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = warm_cli("train", *overrides(tiny_model_dir, tmp_path, "not-an-rm", "data.task=sort",
                                        f"reward.model.path={tiny_model_dir}"))
    assert proc.returncode != 0
    assert "is LlamaForCausalLM, not a sequence classifier: a reward model is an AutoModelForSequenceClassification" \
        in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "not-an-rm").exists()  # refused before anything was written


@pytest.fixture(scope="module")
def pooled(warm_cli: WarmCli, tiny_model_dir: Path, tiny_rm_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Run:
    return train(warm_cli, tmp_path_factory.mktemp("rm-pool"), "rm-pool", tiny_model_dir, *rm_args(tiny_rm_dir))


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.effect_of("reward.model.path")
def test_rewards_of_a_reward_model_pool(pooled: Run, tiny_rm_dir: Path) -> None:
    assert_scored_by_the_model(pooled, tiny_rm_dir)


@pytest.mark.integration
@pytest.mark.slow
def test_rewards_of_a_colocated_reward_model(warm_cli: WarmCli, tiny_model_dir: Path, tiny_rm_dir: Path,
                                             tmp_path: Path) -> None:
    run = train(warm_cli, tmp_path, "rm-colocated", tiny_model_dir, *rm_args(tiny_rm_dir, "reward.model.placement=colocated"),
                iterations=1)
    assert_scored_by_the_model(run, tiny_rm_dir)


@pytest.mark.integration
@pytest.mark.slow
def test_reward_model_workers_restart_and_survive_their_controller(cli: Cli, warm_cli: WarmCli, tiny_model_dir: Path,
                                                                   tiny_rm_dir: Path, tmp_path: Path,
                                                                   pooled: Run) -> None:
    """A policy rank dies mid-update of iteration 2: the engine, reward model pool included, restarts and
    replays. Then the flow process is killed after that update; the engine lives on, and the resumed run
    attaches to it (both pools) and finishes with the uninterrupted run's weights."""
    args = overrides(tiny_model_dir, tmp_path, "rm-kill", *rm_args(tiny_rm_dir))
    first = cli("train", *args, "debug.kill_rank_mid_update=1", "debug.kill_flow_after=update_policy",
                "debug.kill_iteration=2")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    logs = first.stdout + first.stderr
    assert "iteration 2: the engine failed" in logs, logs[-3000:]  # the restart (its metrics line died with it)
    listed = warm_cli("engine", "list")
    assert "rm-kill" in listed.stdout and "reward_model" in listed.stdout, listed.stdout
    before = buffers(tmp_path, "rm-kill")
    resumed = warm_cli("train", "--resume", "rm-kill", f"storage.root={tmp_path}", REWARD)  # not the killed process
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "attached to the live engine of rm-kill" in resumed.stdout + resumed.stderr
    after = buffers(tmp_path, "rm-kill")
    assert all(after[k] == v for k, v in before.items())
    got = load_file(tmp_path / "rm-kill" / "export" / f"step_{pooled.iterations:06d}" / "model.safetensors")
    want = pooled.weights()
    assert got.keys() == want.keys() and all(bool((got[k] == want[k]).all()) for k in got)
    for i in range(1, pooled.iterations + 1):  # the same scores (the buffers' timing metrics differ)
        got_reward = Batch.from_parquet(str(tmp_path / "rm-kill" / "buffers" / f"iter_{i:06d}" / "reward.parquet"))
        for key in ("score", "rule_score", "rm_score"):
            assert torch.equal(got_reward[key], pooled.buffer(i, "reward")[key]), (i, key)
