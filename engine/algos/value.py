"""Critic loss. Shapes: B batch, T response tokens."""

from __future__ import annotations

import torch

from engine.algos.agg import agg_loss
from engine.algos.masked import masked_mean


def clipped_value_loss(
    *,
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range_value: float,
    loss_agg_mode: str = "token-mean",
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)
    (PPO2 baselines / verl `compute_value_loss`).

    vpreds (current critic), values (critic at rollout time), returns, response_mask: [B, T]
    -> (loss scalar, {"vf_clipfrac"}). vf_clipfrac is the fraction of tokens where the clipped
    term is the larger one.
    """
    vpred_clipped = torch.clamp(vpreds, min=values - clip_range_value, max=values + clip_range_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpred_clipped - returns) ** 2
    loss_mat = torch.maximum(unclipped, clipped)
    loss = 0.5 * agg_loss(loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                          max_response_length=max_response_length)
    vf_clipfrac = masked_mean((clipped > unclipped).to(vpreds.dtype), response_mask).detach()
    return loss, {"vf_clipfrac": vf_clipfrac}
