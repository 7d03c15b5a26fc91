"""Preference losses on pairs of responses to one prompt (DPO and IPO).

Inputs are per-pair sums over each response's trained tokens: the policy's log-likelihood of the chosen
and the rejected response, and the frozen reference's. With the log-ratios h_c = logp_c - ref_c and
h_r = logp_r - ref_r of one pair:

- sigmoid (DPO, Rafailov et al. 2023, arXiv 2305.18290, eq. 7): -log sigmoid(beta * (h_c - h_r));
- ipo (IPO, Azar et al. 2023, arXiv 2310.12036, eq. 17): (h_c - h_r - 1 / (2 * beta))^2.

The implicit rewards are beta * h_c and beta * h_r; a pair is ranked right when the chosen one's is higher.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

PREFERENCE_LOSSES = ("sigmoid", "ipo")
PreferenceLoss = Literal["sigmoid", "ipo"]


def preference_loss(*, chosen_logp: torch.Tensor, rejected_logp: torch.Tensor, ref_chosen_logp: torch.Tensor,
                    ref_rejected_logp: torch.Tensor, beta: float, kind: PreferenceLoss
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """[P] sums -> ([P] losses, stats [P]: the chosen and rejected rewards, their margin, and whether the
    pair is ranked right (1.0 or 0.0))."""
    h_c, h_r = chosen_logp - ref_chosen_logp, rejected_logp - ref_rejected_logp
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * (h_c - h_r))
    elif kind == "ipo":
        losses = (h_c - h_r - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}; allowed: {', '.join(PREFERENCE_LOSSES)}")
    chosen, rejected = (beta * h_c).detach(), (beta * h_r).detach()
    return losses, {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margin": chosen - rejected,
                    "rewards/accuracy": (chosen > rejected).float()}


def sequence_logp(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] token log-probs, [B, T] trained-token mask -> [B] the sum over each row's trained tokens."""
    return (logp * mask.to(logp.dtype)).sum(dim=-1)
