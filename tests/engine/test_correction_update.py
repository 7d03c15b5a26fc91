"""Rollout correction where it changes the loss: the gradient of the policy update with
actor.rollout_correction on, through the update's own path (PolicyWorker.gradients -> accumulate_gradients
-> _micro_loss), against the gradient written out by hand.

The model is a bigram table (the logits at a position are the table's row for the token there), so the
gradient of a table row is the gradient of the loss with respect to the logits of the one position that
reads it: with ppo_clip inside its clip range and token-mean aggregation,

    d loss / d logits[b, t] = -w[b, t] * A[b, t] * r[b, t] / N * (onehot(token[b, t]) - softmax(logits[b, t]))

with r = pi / pi_old, N the number of response tokens and w the importance weight pi_old / pi_rollout,
per token or per sequence, truncated or masked. The weights are written below from the chosen ratios,
not computed by engine.algos.correction. The per-token ratios are chosen so that a sequence's product
differs from their mean (the sequence-level weight is the product: exp of the summed log-ratio), and a
hole in a response (an observation, response_mask 0) and the padded tail carry wild ratios that must
not count. No Ray, no torch.distributed: one process, a plain module in place of the FSDP actor.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.batch import Batch
from engine.config import ActorConfig, RolloutConfig
from engine.workers.policy import PolicySpec, PolicyWorker
from tests.engine.bigram import Bigram

V, PAD = 16, 0
# Three rows, a one-token prompt each, T = 3. Every scoring position reads a distinct input token.
PROMPTS = [[1], [5], [9]]
RESPONSES = [[2, 3, 4], [6, 7, 8], [10, 11, PAD]]
MASK = [[1, 1, 1], [1, 0, 1], [1, 1, 0]]  # row 1: a hole (an observation); row 2: a padded tail
# pi_old / pi_rollout per token; the masked ones (10.0, 5.0) must count for nothing.
Q = [[5.0, 0.2, 1.5], [1.2, 10.0, 1.2], [0.6, 0.7, 5.0]]
# pi / pi_old per token, inside ppo_clip's [0.8, 1.2]
R = [[1.1, 0.9, 1.0], [0.95, 1.0, 1.05], [1.1, 0.9, 1.0]]
ADV = [[1.0, -0.5, 2.0], [0.8, 3.0, -1.2], [1.5, -2.0, 4.0]]
UPPER, LOWER = 2.0, 0.5
# The weights by hand (upper 2, lower 0.5), each row's masked tokens 0.
# Sequence level: products 5 * 0.2 * 1.5 = 1.5, 1.2 * 1.2 = 1.44, 0.6 * 0.7 = 0.42 (the means would be
# 2.233, 1.2, 0.65: truncated to [2, 1.2, 0.65], masked to [0, 1.2, 0.65]).
WEIGHTS = {
    ("token", "truncate"): [[2.0, 0.2, 1.5], [1.2, 0.0, 1.2], [0.6, 0.7, 0.0]],
    ("token", "mask"): [[0.0, 0.0, 1.5], [1.2, 0.0, 1.2], [0.6, 0.7, 0.0]],
    ("sequence", "truncate"): [[1.5] * 3, [1.44, 0.0, 1.44], [0.42, 0.42, 0.0]],
    ("sequence", "mask"): [[1.5] * 3, [1.44, 0.0, 1.44], [0.0, 0.0, 0.0]],  # 0.42 < lower
}
MEAN_WEIGHTS = {  # what a sequence level taking the mean of the ratios would give
    "truncate": [[2.0] * 3, [1.2, 0.0, 1.2], [0.65, 0.65, 0.0]],
    "mask": [[0.0] * 3, [1.2, 0.0, 1.2], [0.65, 0.65, 0.0]],
}




def scoring_logits(table: torch.Tensor) -> torch.Tensor:
    """[B, T, V]: the logits that score each response token (the token before it)."""
    inputs = torch.tensor([p + r[:-1] for p, r in zip(PROMPTS, RESPONSES)])
    return table[inputs]


def make_batch(table: torch.Tensor) -> Batch:
    responses, mask = torch.tensor(RESPONSES), torch.tensor(MASK)
    logp = torch.log_softmax(scoring_logits(table), -1).gather(-1, responses[..., None])[..., 0]  # [B, T]
    old_logp = logp - torch.tensor(R).log()
    rollout_logp = old_logp - torch.tensor(Q).log()
    attention = torch.cat([torch.ones(3, 1, dtype=torch.long), (responses != PAD).long()], dim=1)
    return Batch({"input_ids": torch.cat([torch.tensor(PROMPTS), responses], dim=1), "attention_mask": attention,
                  "responses": responses, "response_mask": mask, "old_logp": old_logp,
                  "rollout_logp": rollout_logp, "adv": torch.tensor(ADV)}, {})


def by_hand(table: torch.Tensor, weights: list[list[float]]) -> torch.Tensor:
    """The table's gradient from the formula in the module docstring."""
    mask = torch.tensor(MASK, dtype=torch.float32)
    coef = -torch.tensor(weights) * torch.tensor(ADV) * torch.tensor(R) * mask / mask.sum()  # [B, T]
    onehot = torch.nn.functional.one_hot(torch.tensor(RESPONSES), V).float()
    per_position = coef[..., None] * (onehot - torch.softmax(scoring_logits(table), -1))  # [B, T, V]
    grad = torch.zeros(V, V)
    for b, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        for t, token in enumerate(p + r[:-1]):
            grad[token] += per_position[b, t]
    return grad


def update_gradient(level: str, mode: str, micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the update's gradient of the table, the table) with the correction configured as given."""
    actor = ActorConfig(policy_loss="ppo_clip", loss_agg_mode="token-mean", share_prompts=False,
                        clip_low=0.2, clip_high=0.2, entropy_coeff=0.0,
                        rollout_correction={"mode": mode, "level": level, "upper": UPPER, "lower": LOWER})
    spec = PolicySpec(model_path="unused", tokenizer_path="unused", actor=actor,
                      rollout=RolloutConfig(temperature=1.0, max_new_tokens=3))
    worker = PolicyWorker(spec=spec.model_dump(), run_id="t", role="policy", rank=0, world_size=1,
                          config_hash="t", num_threads=torch.get_num_threads())
    worker.actor = Bigram(V)
    worker.optimizer = torch.optim.SGD(worker.actor.parameters(), lr=0.0)
    table = worker.actor.table.detach().clone()
    grads = worker.gradients(make_batch(table), micro_batch_size=micro_batch_size)
    return grads["table"], table


@pytest.mark.parametrize("micro_batch_size", [3, 1])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_update_gradient_is_the_weighted_one(level: str, mode: str, micro_batch_size: int) -> None:
    grad, table = update_gradient(level, mode, micro_batch_size)
    expected = by_hand(table, WEIGHTS[(level, mode)])
    assert float(expected.norm()) > 0.05
    assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-7), float((grad - expected).abs().max())
    unweighted = by_hand(table, [[1.0] * 3] * 3)  # the update without the correction
    assert float((grad - unweighted).norm()) > 0.2 * float(expected.norm())
    if level == "sequence":  # the data tells the product of the ratios from their mean
        mean = by_hand(table, MEAN_WEIGHTS[mode])
        assert float((grad - mean).norm()) > 0.2 * float(expected.norm())


def test_the_hand_weights_follow_the_ratios() -> None:
    """The WEIGHTS table is the rule applied to Q, written out once more as arithmetic (a typo guard)."""
    for b, (q, m) in enumerate(zip(Q, MASK)):
        kept = [x for x, keep in zip(q, m) if keep]
        product = math.prod(kept)
        assert WEIGHTS[("sequence", "truncate")][b] == pytest.approx([min(product, UPPER) * k for k in m])
        inside = LOWER <= product <= UPPER
        assert WEIGHTS[("sequence", "mask")][b] == pytest.approx([product * inside * k for k in m])
        assert WEIGHTS[("token", "truncate")][b] == pytest.approx([min(x, UPPER) * k for x, k in zip(q, m)])
        assert WEIGHTS[("token", "mask")][b] == pytest.approx([x * (LOWER <= x <= UPPER) * k for x, k in zip(q, m)])
