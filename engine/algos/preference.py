"""Preference losses on pairs of responses to one prompt (DPO and IPO).

Inputs are per-pair sums over each response's trained tokens: the policy's log-likelihood of the chosen
and the rejected response, and the frozen reference's. With the log-ratios h_c = logp_c - ref_c and
h_r = logp_r - ref_r of one pair:

- sigmoid (DPO, Rafailov et al. 2023, arXiv 2305.18290, eq. 7): -log sigmoid(beta * (h_c - h_r));
- ipo (IPO, Azar et al. 2023, arXiv 2310.12036, eq. 17): (h_c - h_r - 1 / (2 * beta))^2.

A response's log-likelihood is the sum over its tokens (the papers'); `sequence_logp(reduce="mean")` gives
the mean instead, which makes h a per-token log-ratio: TRL's DPOTrainer does that for IPO
(trl/trainer/dpo_trainer.py divides the policy's and the reference's log-probs by the response's length
when loss_type="ipo"), here algorithm.ipo_logratio=mean.

The implicit rewards are beta * h_c and beta * h_r; a pair is ranked right when the chosen one's is higher.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

PREFERENCE_LOSSES = ("sigmoid", "ipo")
PreferenceLoss = Literal["sigmoid", "ipo"]
LogpReduce = Literal["sum", "mean"]


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


def sequence_logp(logp: torch.Tensor, mask: torch.Tensor, reduce: LogpReduce = "sum") -> torch.Tensor:
    """[B, T] token log-probs, [B, T] trained-token mask -> [B] the sum over each row's trained tokens, or
    with reduce="mean" their mean (0 for a row without one)."""
    mask = mask.to(logp.dtype)
    total = (logp * mask).sum(dim=-1)
    if reduce == "sum":
        return total
    if reduce == "mean":
        return total / mask.sum(dim=-1).clamp(min=1)
    raise ValueError(f"unknown reduce {reduce!r}; allowed: sum, mean")
