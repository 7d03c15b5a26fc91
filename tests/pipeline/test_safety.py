"""Safe RL (Safe-RLHF's Lagrangian) through `rlflow train`: the tiny model rewarded for digits
(digit_share) with a cost on its length (length_cost, the share of the 8 new tokens used) and a cost
limit of 0.5. Unconstrained, the length stays near the maximum while the reward rises; constrained, with
the multiplier starting at 0, it grows while the mean cost is over the limit, the cost falls under it, and
the multiplier falls back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.pipeline.test_algorithms import HERE, train
from tests.services import WarmCli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LIMIT, ITERATIONS = 0.5, 8
COST = (f"reward.cost_function={HERE / 'rewards.py'}:length_cost", f"algorithm.cost_limit={LIMIT}",
        "algorithm.lagrange_init=0", "algorithm.lagrange_lr=1.0")  # no pressure but what the multiplier learns


def test_the_cost_falls_under_its_limit(warm_cli: WarmCli, tiny_model_dir: Path, tmp_path: Path) -> None:
    free = train(warm_cli, tmp_path, "unconstrained", tiny_model_dir, iterations=ITERATIONS)
    safe = train(warm_cli, tmp_path, "safe", tiny_model_dir, *COST, iterations=ITERATIONS)
    cost = safe.series("safety/cost/mean")
    lam = safe.series("safety/lambda")
    free_length = [m / 8 for m in free.series("response_length/mean")]
    print("cost (unconstrained):", [round(c, 3) for c in free_length])
    print("cost (constrained):  ", [round(c, 3) for c in cost], "lambda:", [round(x, 3) for x in lam])
    assert cost[0] > LIMIT and max(cost[-3:]) < LIMIT  # over the limit, then under it
    assert min(free_length[-3:]) > LIMIT  # without the constraint it stays over
    # lambda: 0 before iteration 1, then + lr * (cost - limit) each iteration, from that iteration's responses:
    # up while the cost is over the limit, down once it is under
    expected = 0.0
    for c, got in zip(cost, lam):
        expected = min(max(expected + 1.0 * (c - LIMIT), 0.0), 100.0)
        assert got == pytest.approx(expected, abs=1e-9)
    top = lam.index(max(lam))
    assert 0 < top < len(lam) - 1 and lam[-1] < lam[top]
    # the cost buffer holds the rule's cost, and the advantage stage used (score - lambda cost) / (1 + lambda)
    for i in (1, ITERATIONS):
        costs = safe.buffer(i, "cost")["cost"]
        lengths = [len(t) / 8 for t in safe.buffer(i, "rollout")["response_text"]]
        assert costs.tolist() == pytest.approx(lengths)
        score = safe.buffer(i, "reward")["score"]
        combined = safe.buffer(i, "advantage")["token_scores"].sum(-1)
        assert torch.allclose(combined, (score - lam[i - 1] * costs) / (1 + lam[i - 1]), atol=1e-6)
    # the next iteration reads lambda from the advantage buffer's record, the one source
    assert safe.buffer(ITERATIONS, "advantage").meta["metrics"]["safety/lambda"] == lam[-1]
