"""Every algorithm path through the flow at least once (`rlflow train`, real stack, up to 3 iterations of
the tiny model), each asserting what its path must produce, from the run's own buffers and metrics; and
in every run, each buffer holds exactly the columns its stage declares (flows/algorithms.py)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from engine.algos import masked_mean, masked_whiten
from engine.batch import Batch
from flows.algorithms import stages_for
from flows.config import load_config
from tests.services import Cli, WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HERE = Path(__file__).resolve().parent
REWARD = f"reward.function={HERE / 'rewards.py'}:digit_share"
ITERATIONS, N, PROMPTS = 3, 4, 4


def overrides(model: Path, root: Path, run_id: str, *extra: str) -> list[str]:
    return [f"model.path={model}", f"storage.root={root}", f"trainer.run_id={run_id}", REWARD,
            f"trainer.total_iterations={ITERATIONS}", f"trainer.save_every={ITERATIONS}", "trainer.val_every=0",
            f"data.train_batch_size={PROMPTS}", f"rollout.n={N}", "actor.mini_batch_size=16",
            "actor.micro_batch_size=8", "data.train_size=64", "data.val_size=8", "rollout.max_new_tokens=8",
            "actor.lr=1e-3", *extra]


class Run:
    def __init__(self, root: Path, run_id: str, args: list[str], iterations: int = ITERATIONS) -> None:
        self.root, self.run_id, self.args, self.iterations = root, run_id, args, iterations

    def metrics(self, iteration: int) -> dict[str, float]:
        return json.loads((self.root / self.run_id / "metrics" / f"iter_{iteration:06d}.json").read_text())

    def buffer(self, iteration: int, name: str) -> Batch:
        return Batch.from_parquet(str(self.root / self.run_id / "buffers" / f"iter_{iteration:06d}" / f"{name}.parquet"))

    def series(self, key: str) -> list[float]:
        return [self.metrics(i)[key] for i in range(1, self.iterations + 1)]

    def weights(self) -> dict[str, torch.Tensor]:
        return load_file(self.root / self.run_id / "export" / f"step_{self.iterations:06d}" / "model.safetensors")


def train(cli: Cli | WarmCli, root: Path, run_id: str, model: Path, *extra: str, iterations: int = ITERATIONS,
          env: dict[str, str] | None = None) -> Run:
    args = overrides(model, root, run_id, *extra)
    if iterations != ITERATIONS:
        args += [f"trainer.total_iterations={iterations}", f"trainer.save_every={iterations}"]
    proc = cli("train", *args, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = Run(root, run_id, args, iterations)
    assert_buffers_are_the_declared_writes(run)
    return run


def assert_buffers_are_the_declared_writes(run: Run) -> None:
    """The declared graph is the executed graph: every declared buffer exists with exactly its columns,
    and no other buffer was written."""
    stages = stages_for(load_config(None, run.args))
    declared = {s.buffer: set(s.writes) for s in stages if s.buffer}
    for i in range(1, run.iterations + 1):
        folder = run.root / run.run_id / "buffers" / f"iter_{i:06d}"
        assert {p.stem for p in folder.glob("*.parquet")} - {"validation"} == set(declared)
        for name, columns in declared.items():
            assert set(pq.read_schema(folder / f"{name}.parquet").names) == columns, name


def close(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, atol: float = 1e-5) -> None:
    assert float((a - b)[mask.bool()].abs().max()) <= atol


def group_of(batch: Batch) -> torch.Tensor:
    return batch["group_id"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("algorithms")


@pytest.fixture(scope="module")
def adaptive_kl_remax(warm_cli: WarmCli, tiny_model_dir: Path, root: Path) -> Run:
    return train(warm_cli, root, "remax-kl", tiny_model_dir, *REMAX_KL)


REMAX_KL = ("algorithm.adv_estimator=remax", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl=adaptive",
            "algorithm.kl_coef=0.05", "algorithm.kl_target=1.0", "algorithm.kl_horizon=100")


@pytest.fixture(scope="module")
def every_path(warm_cli: WarmCli, tiny_model_dir: Path, root: Path) -> Run:
    """One run through many paths of the config: PPO with a critic, KL in the reward with the adaptive
    controller and as a loss, an entropy bonus, GSPO with two PPO epochs, validation, a user stage, DAPO's
    overlong shaping. (Every field's own effect: tests/pipeline/test_every_field.py.)"""
    return train(warm_cli, root, "every-path", tiny_model_dir, "critic.enable=true", "algorithm.adv_estimator=gae",
                 "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl=adaptive", "actor.use_kl_loss=true",
                 "actor.kl_loss_coef=0.1", "actor.entropy_coeff=0.01", "actor.policy_loss=gspo",
                 "actor.loss_agg_mode=seq-mean-token-mean", "actor.ppo_epochs=2", "actor.clip_low=0.001",
                 "actor.clip_high=0.001", "trainer.val_every=2", "trainer.iterations_per_run=2",
                 f"algorithm.extra_stages={HERE / 'stages.py'}:brevity", "reward.overlong_buffer_len=3",
                 "reward.overlong_penalty_factor=0.5", iterations=2)  # fmt: skip


@pytest.mark.effect_of("reward.overlong_buffer_len")
def test_overlong_shaping_is_in_the_scores(every_path: Run) -> None:
    """DAPO's overlong shaping: the reward buffer's score is the rule's plus the penalty of its length
    (max_new_tokens 8, buffer 3, factor 0.5: -1/6 per token over 5)."""
    from tests.pipeline.rewards import digit_share

    run = every_path
    for i in range(1, run.iterations + 1):
        rollout, reward = run.buffer(i, "rollout"), run.buffer(i, "reward")
        lengths = rollout["response_mask"].sum(dim=1)
        rule = torch.tensor([digit_share(s, t, g, e) for s, t, g, e in zip(
            rollout["data_source"], rollout["response_text"], rollout["ground_truth"], rollout["extra_info"],
            strict=True)])  # fmt: skip
        penalty = torch.clamp(-(lengths.float() - 5) / 3 * 0.5, max=0.0)
        assert torch.allclose(reward["score"], rule + penalty, atol=1e-6)
        assert run.metrics(i)["reward/overlong_penalty_mean"] == pytest.approx(float(penalty.mean()), abs=1e-6)
    assert any(run.metrics(i)["reward/overlong_share"] > 0 for i in range(1, run.iterations + 1))


def test_kl_loss_entropy_bonus_and_gspo(every_path: Run) -> None:
    """The reference is the initial policy: at iteration 1 ref_logp equals old_logp, later it does not
    and the KL loss is positive; the entropy bonus is in the loss that was minimised; GSPO clips."""
    run = every_path
    mask = run.buffer(1, "rollout")["response_mask"]
    close(run.buffer(1, "ref_logprob")["ref_logp"], run.buffer(1, "old_logprob")["old_logp"], mask, atol=1e-6)
    later = run.buffer(2, "rollout")["response_mask"].bool()
    assert float((run.buffer(2, "ref_logprob")["ref_logp"] - run.buffer(2, "old_logprob")["old_logp"])[later]
                 .abs().max()) > 1e-3
    for i in range(1, run.iterations + 1):
        m = run.metrics(i)
        assert m["actor/entropy"] > 0
        assert m["actor/loss"] == pytest.approx(m["actor/pg_loss"] - 0.01 * m["actor/entropy"]
                                                + 0.1 * m["actor/kl_loss"], rel=1e-5, abs=1e-7)
    assert run.metrics(2)["actor/kl_loss"] > 0
    assert max(run.series("actor/pg_clipfrac")) > 0  # the second PPO epoch's ratios leave the clip range


@pytest.mark.effect_of("algorithm.use_kl_in_reward", "algorithm.kl_ctrl", "algorithm.kl_coef", "algorithm.kl_horizon")
def test_adaptive_kl_in_the_reward_and_remax_baseline(adaptive_kl_remax: Run) -> None:
    """The in-reward KL is positive once the policy moved, and the rewards are the scores less the
    iteration's coefficient times it; the adaptive coefficient follows its controller (KL below target:
    it falls); ReMax's advantage is reward-to-go minus the greedy baseline's reward, which is constant
    within a group."""
    run = adaptive_kl_remax
    coefs, kls = run.series("actor/kl_coef"), run.series("actor/reward_kl_penalty")
    assert coefs[0] == 0.05 and kls[0] == pytest.approx(0.0, abs=1e-6) and kls[1] > 0
    for k in range(1, ITERATIONS):  # beta <- beta * (1 + clip(kl / target - 1, +-0.2) * n / horizon)
        error = min(max(kls[k - 1] / 1.0 - 1, -0.2), 0.2)
        assert coefs[k] == pytest.approx(coefs[k - 1] * (1 + error * PROMPTS * N / 100), rel=1e-12)
        assert coefs[k] < coefs[k - 1]
    for i in range(1, ITERATIONS + 1):
        adv, baseline = run.buffer(i, "advantage"), run.buffer(i, "baseline_reward")["baseline_score"]
        mask = adv["response_mask"]
        to_go = (adv["token_rewards"] * mask).flip(-1).cumsum(-1).flip(-1)
        close(adv["adv"], to_go - baseline.unsqueeze(1), mask)
        # the KL in the reward: score - reward per token is coef x KL, its batch mean the reported KL's
        in_reward = masked_mean((adv["token_scores"] - adv["token_rewards"]).double(), mask.double(), dim=-1).mean()
        assert float(in_reward) == pytest.approx(coefs[i - 1] * kls[i - 1], rel=1e-4, abs=1e-6), i
        assert torch.equal(baseline.view(PROMPTS, N), baseline.view(PROMPTS, N)[:, :1].expand(PROMPTS, N))
        assert set(run.buffer(i, "baseline").keys()) == {"baseline_responses", "baseline_response_mask",
                                                          "baseline_response_text"}


def test_adaptive_kl_killed_and_resumed_has_the_same_kl_coef_series(cli: Cli, warm_cli: WarmCli,
                                                                     tiny_model_dir: Path, root: Path,
                                                                     adaptive_kl_remax: Run) -> None:
    """Killed in iteration 2 after the checkpoint of iteration 1: the resume takes the controller from what
    that checkpoint committed (trainer.json), not from the metrics files, which the test edits before
    resuming (on main the resumed iteration 2 ran with the edited coefficient's update)."""
    args = overrides(tiny_model_dir, root, "remax-kl-killed", *REMAX_KL, "trainer.save_every=1",
                     "debug.kill_flow_after=compute_advantages", "debug.kill_iteration=2")
    first = cli("train", *args)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    line = root / "remax-kl-killed" / "metrics" / "iter_000001.json"
    edited = {**json.loads(line.read_text()), "actor/kl_coef": 0.5, "actor/reward_kl_penalty": 9.0}
    line.write_text(json.dumps(edited))
    state = json.loads((root / "remax-kl-killed" / "checkpoints" / "step_000001" / "trainer.json").read_text())
    assert state == {"iteration": 1, "kl_ctrl": {"value": adaptive_kl_remax.series("actor/kl_coef")[1]}}
    resumed = warm_cli("train", "--resume", "remax-kl-killed", f"storage.root={root}", REWARD)  # not the killed process
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    run = Run(root, "remax-kl-killed", args)
    assert run.series("actor/kl_coef")[1:] == adaptive_kl_remax.series("actor/kl_coef")[1:]  # to the bit
    got, want = run.weights(), adaptive_kl_remax.weights()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.effect_of("algorithm.adv_estimator")
def test_rloo(warm_cli: WarmCli, tiny_model_dir: Path, root: Path) -> None:
    """adv = r_i - the mean of the other responses of its prompt (one rank, one iteration: the formula is
    of one iteration's scores, computed in the advantage stage, not on the ranks)."""
    run = train(warm_cli, root, "rloo", tiny_model_dir, "algorithm.adv_estimator=rloo",
                "trainer.world_size=1", iterations=1)
    for i in range(1, run.iterations + 1):
        adv, score = run.buffer(i, "advantage"), run.buffer(i, "reward")["score"]
        per_group = score.view(PROMPTS, N)
        others = (per_group.sum(1, keepdim=True) - per_group) / (N - 1)
        close(adv["adv"], (per_group - others).flatten().unsqueeze(1).expand_as(adv["adv"]), adv["response_mask"])


def test_reinforce_plus_plus(warm_cli: WarmCli, tiny_model_dir: Path, root: Path) -> None:
    """REINFORCE++: the reward-to-go (gamma 1: the outcome score at every token), whitened over the batch
    (one rank, one iteration, as test_rloo)."""
    run = train(warm_cli, root, "rpp", tiny_model_dir, "algorithm.adv_estimator=reinforce_plus_plus",
                "trainer.world_size=1", iterations=1)
    for i in range(1, run.iterations + 1):
        adv, score = run.buffer(i, "advantage"), run.buffer(i, "reward")["score"]
        mask = adv["response_mask"]
        close(adv["returns"], score.unsqueeze(1).expand_as(mask).float(), mask)
        close(adv["adv"], masked_whiten(adv["returns"], mask), mask)
        assert abs(float(masked_mean(adv["adv"], mask))) < 1e-5


@pytest.mark.effect_of("algorithm.extra_stages")
def test_dr_grpo_with_a_user_stage_as_second_reward(warm_cli: WarmCli, tiny_model_dir: Path, root: Path) -> None:
    """Dr. GRPO: adv = r - the group mean (no std), Dr. GRPO's loss normalizer; the reward r is the rule
    score plus 0.5 x the `brevity` stage declared in tests/pipeline/stages.py (no edit of the flow); one rank,
    one iteration, as test_rloo."""
    run = train(warm_cli, root, "dr-grpo", tiny_model_dir, "algorithm.adv_estimator=dr_grpo",
                "actor.loss_agg_mode=seq-mean-token-sum-norm", f"algorithm.extra_stages={HERE / 'stages.py'}:brevity",
                "trainer.world_size=1", iterations=1)
    for i in range(1, run.iterations + 1):
        adv, rule = run.buffer(i, "advantage"), run.buffer(i, "reward")["score"]
        brevity = run.buffer(i, "brevity")["brevity"]
        combined = (rule + 0.5 * brevity).view(PROMPTS, N)
        centred = (combined - combined.mean(1, keepdim=True)).flatten()
        close(adv["adv"], centred.unsqueeze(1).expand_as(adv["adv"]), adv["response_mask"])
        assert float(adv["token_scores"].sum()) == pytest.approx(float((rule + 0.5 * brevity).sum()), rel=1e-5)
        m = run.metrics(i)
        assert m["reward/brevity/mean"] == pytest.approx(float(brevity.mean()), rel=1e-6)
        assert m["critic/score/mean"] == pytest.approx(float(combined.mean()), rel=1e-5)


def test_rollout_correction_reaches_the_update(warm_cli: WarmCli, tiny_model_dir: Path, root: Path) -> None:
    """Masked sequence-level correction on an on-policy run that samples with top-k 3: the rollout's own
    log-probs are of the truncated distribution, the trainer's of the full one, so the gap is real. The
    update's metrics equal what the advantage buffer's two columns give by hand (16 rows, one micro-batch of
    8 per rank: the ranks' mean is the mean over rows)."""
    run = train(warm_cli, root, "corrected", tiny_model_dir, "rollout.top_k=3", "actor.old_log_prob=recompute",
                "actor.rollout_correction.mode=mask", "actor.rollout_correction.level=sequence",
                "actor.rollout_correction.upper=1.05", "actor.rollout_correction.lower=0.95", iterations=2)
    for i in (1, 2):
        adv, m = run.buffer(i, "advantage"), run.metrics(i)
        mask = adv["response_mask"].double()
        gap = (adv["old_logp"].double() - adv["rollout_logp"].double()) * mask
        assert float(gap.sum()) < 0  # top-k 3 made every drawn token likelier under the rollout's distribution
        ratio = gap.sum(-1).exp()
        outside = ((ratio < 0.95) | (ratio > 1.05)).double()
        assert m["rollout_corr/corrected_share"] == pytest.approx(float(outside.mean()), abs=1e-5)
        assert 0 < m["rollout_corr/corrected_share"]
        assert m["rollout_corr/is_weight_mean"] == pytest.approx(float(ratio.mean()), rel=1e-4)
        assert m["rollout_corr/is_weight_max"] == pytest.approx(float(ratio.max()), rel=1e-4)
        per_row = gap.sum(-1) / mask.sum(-1)
        assert m["rollout_corr/log_ppl_diff"] == pytest.approx(float(per_row.mean()), rel=1e-4)
        assert m["rollout_corr/kl_k3"] > 0  # a token mean per rank (its formula: tests/algos/test_correction.py)


def test_a_stage_reading_a_column_nobody_writes_is_refused_before_launch(warm_cli: WarmCli, tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    proc = warm_cli("train", *overrides(tiny_model_dir, tmp_path, "refused",
                                        f"algorithm.extra_stages={HERE / 'stages.py'}:reads_a_column_nobody_writes"))
    assert proc.returncode != 0
    assert ("stage reads_a_column_nobody_writes reads politeness, which no earlier stage writes"
            in proc.stderr), proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "refused").exists()
