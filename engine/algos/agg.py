"""Loss aggregation: a [B, T] matrix of per-token losses -> one scalar.

Shapes: B batch, T response tokens (the padded response length). Masks are 0/1.

Every mode is a ratio `numerator / units`: the numerator is a sum over sequences (of token sums or
token means), `units` (`agg_units`) counts what the mode averages over: unmasked tokens for
token-mean, non-empty sequences for the seq-* modes. Because the numerator is additive over rows,
the aggregate over a global mini-batch split into micro-batches (and ranks) is recovered exactly by
weighting each micro-batch's aggregate with `units(micro) / units(global mini-batch)`; the engine
does that (engine/workers/fsdp.micro_weights), so the gradient does not depend on the micro-batch
size, the last chunk's size or the world size.

Divisors follow verl `agg_loss` (`verl/trainer/ppo/core_algos.py`) except Dr. GRPO's, see
`_seq_mean_token_sum_norm`. verl too (at b178a3c, January 2026) divides by the global mini-batch's tokens
or sequences (its `batch_num_tokens`, `global_batch_size` and `dp_size` arguments), as micro_weights does.
"""

from __future__ import annotations

import torch

from engine.algos.masked import masked_sum


def _nonempty(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B] float: 1 for a sequence with at least one unmasked token."""
    return (loss_mask.sum(dim=-1) > 0).to(torch.float32)


def _token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor, max_response_length: int | None) -> torch.Tensor:
    """Mean over every unmasked token of the batch (DAPO, Yu et al. 2025, sec. 3.3)."""
    # clamp: an all-masked batch gives 0 rather than verl's 0/0 = NaN
    return masked_sum(loss_mat, loss_mask) / loss_mask.sum().clamp_min(1)


def _seq_mean_token_sum(loss_mat: torch.Tensor, loss_mask: torch.Tensor, max_response_length: int | None
                        ) -> torch.Tensor:
    """Sum over each sequence's tokens, then mean over non-empty sequences."""
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)  # [B]
    nonempty = _nonempty(loss_mask).to(seq_losses.dtype)  # [B]
    return (seq_losses * nonempty).sum() / nonempty.sum().clamp_min(1)


def _seq_mean_token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor, max_response_length: int | None
                         ) -> torch.Tensor:
    """Mean over each sequence's tokens, then mean over non-empty sequences (GRPO, Shao et al. 2024, eq. 3)."""
    lengths = loss_mask.sum(dim=-1)  # [B]
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1) / (lengths + 1e-8)  # [B]; 1e-8 as verl
    nonempty = (lengths > 0).to(seq_losses.dtype)  # [B]
    return (seq_losses * nonempty).sum() / nonempty.sum().clamp_min(1)


def _seq_mean_token_sum_norm(loss_mat: torch.Tensor, loss_mask: torch.Tensor, max_response_length: int | None
                             ) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, arXiv 2503.20783, sec. 3.2): each sequence's token sum divided by a
    constant, the maximum response length L, then the mean over non-empty sequences; TRL's
    `loss_type="dr_grpo"` divides by B * L likewise.

    L is `max_response_length` (the configured generation limit), never the width this batch
    happens to be padded to, so the normalizer is the same at every step and in every micro-batch.
    verl divides the sum over the batch's sequences by its `loss_scale_factor` (actor config, since
    verl PR #4360: a constant can be set; by default the padded width T) and not by the number of
    sequences, so its loss scales with the batch size; here the scale is the same for any batch size.
    Without `max_response_length`, T is used.
    """
    length = loss_mask.shape[-1] if max_response_length is None else max_response_length
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1) / length  # [B]
    nonempty = _nonempty(loss_mask).to(seq_losses.dtype)  # [B]
    return (seq_losses * nonempty).sum() / nonempty.sum().clamp_min(1)


_AGG_FNS = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
LOSS_AGG_MODES: tuple[str, ...] = tuple(_AGG_FNS)


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in _AGG_FNS:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; allowed: {list(LOSS_AGG_MODES)}")


def agg_loss(*, loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str,
             max_response_length: int | None = None) -> torch.Tensor:
    """Aggregate per-token losses (verl `agg_loss`).

    loss_mat, loss_mask: [B, T] -> scalar. loss_agg_mode: one of LOSS_AGG_MODES.
    max_response_length: Dr. GRPO's constant normalizer (seq-mean-token-sum-norm only).
    """
    _check_mode(loss_agg_mode)
    return _AGG_FNS[loss_agg_mode](loss_mat, loss_mask, max_response_length)


def agg_units(*, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """What `loss_agg_mode` averages over, counted in `loss_mask` [B, T] -> scalar: unmasked tokens
    for token-mean, non-empty sequences for the seq-* modes. The aggregate of a union of batches is
    the units-weighted mean of their aggregates."""
    _check_mode(loss_agg_mode)
    if loss_agg_mode == "token-mean":
        return loss_mask.sum().to(torch.float32)
    return _nonempty(loss_mask).sum()
