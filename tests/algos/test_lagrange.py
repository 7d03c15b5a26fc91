"""Safe RL's multiplier step and Lagrangian scores, by hand."""

from __future__ import annotations

import torch

from engine.algos import lagrangian_scores, update_multiplier


def test_multiplier_follows_the_cost_over_the_limit() -> None:
    assert update_multiplier(1.0, 0.9, 0.5, 0.1, 100.0) == 1.0 + 0.1 * 0.4
    assert update_multiplier(1.0, 0.2, 0.5, 0.1, 100.0) == 1.0 - 0.1 * 0.3
    assert update_multiplier(0.01, 0.0, 0.5, 0.1, 100.0) == 0.0  # never negative
    assert update_multiplier(99.99, 5.0, 0.5, 0.1, 100.0) == 100.0  # at most lagrange_max


def test_lagrangian_scores() -> None:
    got = lagrangian_scores(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 1.0]), 3.0)
    assert got.tolist() == [(1.0 - 1.5) / 4, (0.0 - 3.0) / 4]
