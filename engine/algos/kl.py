"""KL between the policy and the reference policy: per-token estimators, the KL loss, the
in-reward KL penalty and the KL coefficient controllers.

Shapes: B batch, T response tokens. Per-token estimators of KL(pi || pi_ref) from samples of pi,
with d = logp - ref_logp (J. Schulman, "Approximating KL divergence", 2020,
http://joschu.net/blog/kl-approx.html); definitions and clamps as verl `kl_penalty_forward`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from engine.algos.agg import agg_loss
from engine.algos.masked import masked_mean

# verl kl_penalty_forward (low_var_kl): clamp the log-ratio before exp, then the estimate.
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def kl_k1(*, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = d: unbiased, high variance, can be negative. [B, T] -> [B, T]."""
    return logp - ref_logp


def kl_abs(*, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|d|. [B, T] -> [B, T]."""
    return (logp - ref_logp).abs()


def kl_k2(*, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = d^2 / 2: biased, low variance; its gradient is the KL's gradient. [B, T] -> [B, T]."""
    return 0.5 * (logp - ref_logp).square()


def kl_k3(*, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(-d) + d - 1 >= 0: unbiased, low variance (GRPO, Shao et al. 2024, eq. 4).

    [B, T] -> [B, T]; -d clamped to [-20, 20] and the result to [-10, 10] as verl.
    """
    neg_d = (ref_logp - logp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.exp(neg_d) - neg_d - 1.0).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


_KL_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "k1": kl_k1,
    "kl": kl_k1,
    "abs": kl_abs,
    "k2": kl_k2,
    "mse": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_k3,
}
KL_ESTIMATORS: tuple[str, ...] = tuple(_KL_FNS)


def kl_penalty(*, logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate by name (verl `kl_penalty`). logp, ref_logp: [B, T] -> [B, T].

    estimator: one of KL_ESTIMATORS ("kl" = "k1", "mse" = "k2", "low_var_kl" = "k3").
    """
    if estimator not in _KL_FNS:
        raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {list(KL_ESTIMATORS)}")
    return _KL_FNS[estimator](logp=logp, ref_logp=ref_logp)


def kl_loss(
    *,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str,
    loss_agg_mode: str = "token-mean",
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-to-reference term added to the actor loss (GRPO, Shao et al. 2024, eq. 3; verl
    `use_kl_loss` in dp_actor). logp, ref_logp, response_mask: [B, T] -> (loss scalar, stats)."""
    kld = kl_penalty(logp=logp, ref_logp=ref_logp, estimator=estimator)
    loss = agg_loss(loss_mat=kld, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                    max_response_length=max_response_length)
    return loss, {"kl_loss": loss.detach()}


def apply_kl_penalty(
    *,
    token_scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """In-reward KL: r_t = score_t - kl_coef * KL_t (Ziegler et al. 2019, arXiv 1909.08593,
    sec. 2; verl `apply_kl_penalty` in ray_trainer).

    token_scores, logp (the rollout policy's, i.e. old_logp), ref_logp, response_mask: [B, T]
    -> (token_rewards [B, T], stats). stats["reward_kl_penalty"] is the batch KL: the mean over
    sequences of each sequence's masked token mean, the input to `KLController.update`.
    """
    kld = kl_penalty(logp=logp, ref_logp=ref_logp, estimator=estimator)
    kld = torch.where(response_mask.bool(), kld, torch.zeros_like(kld))
    token_rewards = token_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean()  # [B, T] -> [B] -> scalar
    stats = {
        "reward_kl_penalty": current_kl.detach(),
        "reward_kl_penalty_coeff": torch.tensor(kl_coef, dtype=kld.dtype, device=kld.device),
    }
    return token_rewards, stats


class FixedKLController:
    """Constant KL coefficient (verl `FixedKLController`)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller towards a target KL (Ziegler et al. 2019, arXiv 1909.08593,
    sec. 2; verl `AdaptiveKLController`):
    e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    """

    ERROR_CLIP = 0.2

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """current_kl: the batch KL (apply_kl_penalty stats); n_steps: responses in the batch."""
        error = min(max(current_kl / self.target_kl - 1.0, -self.ERROR_CLIP), self.ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController
