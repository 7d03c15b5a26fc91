"""Safe RL's Lagrange multiplier (Safe-RLHF: Dai et al. 2023, arXiv 2310.12773).

The constrained problem max_theta J_R(theta) subject to J_C(theta) <= d has the Lagrangian
min_{lambda >= 0} max_theta J_R - lambda * (J_C - d). The policy ascends it: its reward is
r - lambda * c (divided by 1 + lambda, as Safe-RLHF scales it, so the advantage stays on the reward's
scale). The multiplier descends it by a projected gradient step each iteration, from the iteration's own
responses: dL/dlambda = -(J_C - d), so lambda grows while the mean cost is over the limit and shrinks
toward 0 once it is under.
"""

from __future__ import annotations

import torch


def update_multiplier(lam: float, mean_cost: float, limit: float, lr: float, lam_max: float) -> float:
    """lambda after one step: clamp(lambda + lr * (mean_cost - limit), 0, lam_max)."""
    return min(max(lam + lr * (mean_cost - limit), 0.0), lam_max)


def lagrangian_scores(scores: torch.Tensor, costs: torch.Tensor, lam: float) -> torch.Tensor:
    """Per-response scores [B] of the Lagrangian: (reward - lambda * cost) / (1 + lambda)."""
    return (scores.float() - lam * costs.float()) / (1.0 + lam)
