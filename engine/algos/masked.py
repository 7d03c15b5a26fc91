"""Masked reductions and per-token quantities from logits.

Shapes: B batch, T response tokens, V vocabulary. A mask is 0/1 (bool, int or float) with the
shape of the values it selects; positions where it is 0 never influence a result, even if they
hold NaN or garbage.

Semantics follow verl `verl/utils/torch_functional.py` so numbers agree with verl on the same
inputs (Bessel-corrected variance, `rsqrt(var + 1e-8)` whitening, `+ 1e-8` in masked means).
"""

from __future__ import annotations

import torch

# verl torch_functional: masked_mean divides by (mask.sum() + 1e-8); whitening uses var + 1e-8.
MEAN_EPS = 1e-8
WHITEN_EPS = 1e-8


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` where `mask` is set (verl `masked_sum`).

    x, mask: same shape, e.g. [B, T]. Returns a scalar when `dim` is None, else `x` reduced
    over `dim`. Masked-out positions are replaced by 0 first, so NaN padding cannot leak in.
    """
    kept = torch.where(mask.bool(), x, torch.zeros_like(x))
    return (kept * mask).sum() if dim is None else (kept * mask).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the positions selected by `mask` (verl `masked_mean`).

    x, mask: same shape, e.g. [B, T]. `dim=None` -> scalar; `dim=-1` on [B, T] -> [B].
    An all-zero mask gives 0 (the sum is 0, the count is 1e-8), not NaN.
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / (count + MEAN_EPS)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all positions selected by `mask` -> scalar (verl `masked_var`).

    x, mask: same shape, e.g. [B, T]. `unbiased` applies Bessel's correction n / (n - 1).
    verl raises when n <= 1; checking that needs a host sync, so here n - 1 is clamped to 1
    instead: a single selected element has variance 0, and an empty mask gives 0.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum().to(var.dtype)
        var = var * n / (n - 1).clamp_min(1.0)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with statistics over `mask` (verl `masked_whiten`).

    x, mask: same shape, e.g. [B, T] -> same shape. Masked-out positions are transformed too
    (they are not zeroed); callers multiply by the mask when they need zeros there.
    `shift_mean=False` adds the mean back, so only the scale changes.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits): logsumexp(z) - sum_v p_v z_v (verl `entropy_from_logits`).

    logits: [B, T, V] (any leading shape) -> entropy [B, T].
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] as z[label] - logsumexp(z): no [B, T, V] log-softmax is built.

    logits: [B, T, V], labels: LongTensor [B, T] -> logp [B, T].
    Half-precision logits are upcast to float32 one batch row at a time (bf16 logsumexp is
    inaccurate; verl `logprobs_from_logits_v2`), so the extra memory is one [T, V] row; float32 and
    wider logits take one batched op. The result dtype is float32 or wider.
    """
    out_dtype = torch.promote_types(logits.dtype, torch.float32)
    if logits.dtype == out_dtype:  # nothing to upcast: one batched op (no [B, T, V] temporary either)
        return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    rows = []
    for row_logits, row_labels in zip(logits, labels, strict=True):  # row_logits [T, V], row_labels [T]
        row_logits = row_logits.to(out_dtype)
        picked = row_logits.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1)  # [T, 1] -> [T]
        rows.append(picked - torch.logsumexp(row_logits, dim=-1))
    if not rows:  # B == 0
        return logits.new_zeros(labels.shape, dtype=out_dtype)
    return torch.stack(rows)  # B x [T] -> [B, T]


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B]: the index of each row's last 1 (0 for a row without one). Unlike `mask.sum(-1) - 1`,
    right for masks with holes (the tool observations of a multi-turn response)."""
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return ((mask != 0).long() * positions).amax(dim=-1).sub(1).clamp(min=0)
