"""Policy-gradient losses: one registry, one declared input record (LossInputs).

Shapes: B batch, T response tokens. Every loss takes `logp, old_logp, adv, response_mask`
(all [B, T]), clip settings and the aggregation (`loss_agg_mode`, and `max_response_length` for
Dr. GRPO's constant normalizer, see agg.py), and returns `(loss scalar, stats)` where stats always holds the
detached scalars `pg_clipfrac`, `pg_clipfrac_lower` and `ppo_kl` (verl's metric names).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.algos.agg import agg_loss
from engine.algos.masked import masked_mean, masked_sum

# verl compute_policy_loss_vanilla: log-ratio clamp before exp, for stability.
PPO_LOG_RATIO_CLAMP = 20.0
# verl compute_policy_loss_gspo: upper clamp on the sequence log-ratio.
GSPO_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True)
class LossInputs:
    """What every policy loss is given; each reads the fields it needs.

    logp, old_logp, adv, response_mask: [B, T]; clip_low, clip_high: the clip range [1 - clip_low,
    1 + clip_high]; clip_ratio_c: the dual-clip bound for negative advantages; loss_agg_mode and
    max_response_length: the aggregation (agg.py).
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    adv: torch.Tensor
    response_mask: torch.Tensor
    clip_low: float
    clip_high: float
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    max_response_length: int | None = None


LossResult = tuple[torch.Tensor, dict[str, torch.Tensor]]
PolicyLossFn = Callable[[LossInputs], LossResult]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss, called with LossInputs' fields as keywords."""

    name: str
    fn: PolicyLossFn

    def __call__(self, **inputs: Any) -> LossResult:
        return self.fn(LossInputs(**inputs))


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLoss]:
    """Decorator: add a policy loss to POLICY_LOSSES under `name`; returns the registered loss, so the
    module's name calls it with keywords as the registry does."""

    def register(fn: PolicyLossFn) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = PolicyLoss(name=name, fn=fn)
        return POLICY_LOSSES[name]

    return register


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss `name`; ValueError listing the allowed names otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; allowed: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


@register_policy_loss("ppo_clip")
def ppo_clip(x: LossInputs) -> LossResult:
    """Clipped surrogate (Schulman et al. 2017, eq. 7) with asymmetric clip range
    [1 - clip_low, 1 + clip_high] (DAPO clip-higher) and dual clip for adv < 0
    (Ye et al. 2020, arXiv 1912.09729); verl `compute_policy_loss_vanilla`.

    logp, old_logp, adv, response_mask: [B, T] -> (loss scalar, stats).
    Dual clip: for negative advantages the loss is capped at -adv * clip_ratio_c, so a huge
    ratio on a bad token cannot produce an unbounded update.
    """
    logp, old_logp, adv, response_mask = x.logp, x.old_logp, x.adv, x.response_mask
    clip_low, clip_high, clip_ratio_c = x.clip_low, x.clip_high, x.clip_ratio_c
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    log_ratio = (logp - old_logp).clamp(-PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pessimistic = torch.maximum(unclipped, clipped)  # loss form of min(r A, clip(r) A)
    dual_bound = -adv * clip_ratio_c
    pg_losses = torch.where(adv < 0, torch.minimum(pessimistic, dual_bound), pessimistic)
    loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=x.loss_agg_mode,
                    max_response_length=x.max_response_length)
    lower_clipped = (pessimistic > dual_bound) & (adv < 0)
    stats = {
        "pg_clipfrac": masked_mean((clipped > unclipped).to(logp.dtype), response_mask).detach(),
        "pg_clipfrac_lower": masked_mean(lower_clipped.to(logp.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, stats


@register_policy_loss("gspo")
def gspo(x: LossInputs) -> LossResult:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071, GSPO-token form);
    verl `compute_policy_loss_gspo`.

    logp, old_logp, adv, response_mask: [B, T] -> (loss scalar, stats).
    The ratio is per sequence, s_i = exp(mean_t log(pi / pi_old)); each token uses
    s_i,t = sg[s_i] * pi_t / sg[pi_t], equal to s_i in value but with per-token gradients.
    The paper and verl aggregate with "seq-mean-token-mean"; verl forces that mode, here the
    passed `loss_agg_mode` is honoured, so configure it. No dual clip (`clip_ratio_c` unused).
    """
    logp, old_logp, adv, response_mask = x.logp, x.old_logp, x.adv, x.response_mask
    log_ratio = logp - old_logp  # [B, T]
    lengths = response_mask.sum(dim=-1).clamp_min(1)  # [B]
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / lengths  # [B]
    # Straight-through: value sg[seq_log_ratio], gradient d logp. [B] -> [B, 1] broadcast over T.
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=GSPO_LOG_RATIO_MAX))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - x.clip_low, 1.0 + x.clip_high)
    pg_losses = torch.maximum(unclipped, clipped)
    loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=x.loss_agg_mode,
                    max_response_length=x.max_response_length)
    stats = {
        "pg_clipfrac": masked_mean((clipped > unclipped).to(logp.dtype), response_mask).detach(),
        "pg_clipfrac_lower": torch.zeros((), dtype=logp.dtype, device=logp.device),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, stats
