"""Loss aggregation: a [B, T] matrix of per-token losses -> one scalar.

Shapes: B batch, T response tokens (the padded response length). Modes and divisors follow
verl `agg_loss` in `verl/trainer/ppo/core_algos.py` (single process, dp_size 1). Masks are 0/1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.algos.masked import masked_sum


def _token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean over every unmasked token of the batch (DAPO, Yu et al. 2025, sec. 3.3)."""
    # clamp: an all-masked batch gives 0 rather than verl's 0/0 = NaN
    return masked_sum(loss_mat, loss_mask) / loss_mask.sum().clamp_min(1)


def _seq_mean_token_sum(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum over each sequence's tokens, then mean over non-empty sequences."""
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)  # [B]
    nonempty = (loss_mask.sum(dim=-1) > 0).to(seq_losses.dtype)  # [B]
    return (seq_losses * nonempty).sum() / nonempty.sum().clamp_min(1)


def _seq_mean_token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's tokens, then mean over non-empty sequences (GRPO, Shao et al. 2024, eq. 3)."""
    lengths = loss_mask.sum(dim=-1)  # [B]
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1) / (lengths + 1e-8)  # [B]; 1e-8 as verl
    nonempty = (lengths > 0).to(seq_losses.dtype)  # [B]
    return (seq_losses * nonempty).sum() / nonempty.sum().clamp_min(1)


def _seq_mean_token_sum_norm(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum over all tokens divided by T, the padded response length (Dr. GRPO, Liu et al. 2025).

    As in verl the divisor is T alone (not B * T): keep T constant across steps (pad to the
    configured max response length) for the constant normalizer Dr. GRPO prescribes.
    """
    return masked_sum(loss_mat, loss_mask) / loss_mask.shape[-1]


_AGG_FNS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
LOSS_AGG_MODES: tuple[str, ...] = tuple(_AGG_FNS)


def agg_loss(*, loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Aggregate per-token losses (verl `agg_loss`).

    loss_mat, loss_mask: [B, T] -> scalar. loss_agg_mode: one of LOSS_AGG_MODES.
    """
    if loss_agg_mode not in _AGG_FNS:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; allowed: {list(LOSS_AGG_MODES)}")
    return _AGG_FNS[loss_agg_mode](loss_mat, loss_mask)
