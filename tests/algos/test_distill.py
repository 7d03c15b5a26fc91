"""On-policy distillation's advantages: each token's log-ratio, teacher minus student, by hand, through
the advantage stage's own function."""

import pytest
import torch

from engine.advantage import compute_advantages
from engine.algos import distillation_advantages
from engine.batch import Batch
from engine.config import AlgorithmConfig

STUDENT = torch.tensor([[-0.5, -1.0, -2.0, -0.1], [-3.0, -0.2, -0.7, -9.0]])
TEACHER = torch.tensor([[-0.25, -2.0, -1.5, -5.0], [-1.0, -0.2, -0.9, -0.3]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])


def test_each_tokens_advantage_is_its_log_ratio() -> None:
    adv = distillation_advantages(student_logp=STUDENT, teacher_logp=TEACHER, response_mask=MASK)
    # teacher - student, token by token; the padding after the first response counts nothing
    assert torch.allclose(adv, torch.tensor([[0.25, -1.0, 0.5, 0.0], [2.0, 0.0, -0.2, 8.7]]))


def test_the_advantage_stage_under_distillation() -> None:
    """compute_advantages with algorithm.objective=distill: the advantage, the returns and the token
    rewards are the log-ratios (no estimator, no group baseline, no discount); the reward's scores stay a
    metric; the reverse KL is reported as the mean of student - teacher over the response tokens."""
    batch = Batch({"rollout_logp": STUDENT, "teacher_logp": TEACHER, "response_mask": MASK,
                   "token_scores": torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.5]]),
                   "group_id": torch.tensor([0, 0])}, {})
    out, metrics = compute_advantages(batch, AlgorithmConfig(objective="distill"), kl_coef=0.0)
    want = torch.tensor([[0.25, -1.0, 0.5, 0.0], [2.0, 0.0, -0.2, 8.7]])
    for key in ("adv", "returns", "token_rewards"):
        assert torch.allclose(out[key], want), key
    assert torch.equal(out["token_scores"], batch["token_scores"])
    assert metrics["distill/reverse_kl"] == pytest.approx(-(0.25 - 1.0 + 0.5 + 2.0 + 0.0 - 0.2 + 8.7) / 7)
