"""Rollout correction: importance weights between the trainer's policy and the policy that generated.

A rollout is scored by the distribution it was sampled from (`rollout_logp`, the behaviour policy:
the rollout engine's own log-probs after temperature, top-k and top-p), while the update's ratio is
taken against the trainer's log-probs of the same tokens (`old_logp`, the proximal policy). The two
differ when the rollout ran on older weights (an asynchronous run) or on another engine or precision
(vLLM, bf16). The weight w = pi_prox / pi_behav corrects that gap, as in decoupled PPO (Hilton et al.
2021), truncated importance sampling (TIS: min(w, upper)) and masked importance sampling (MIS, IcePop:
w where lower <= w <= upper, else 0), per token or per sequence (w = exp of the summed token log-ratio).

Every registered policy loss is, per token, A times a function of the ratio, so with w >= 0 the
corrected loss equals the loss with advantages w * A: the update applies it that way.

Shapes: B rows, T response tokens; all inputs [B, T]; the weights [B, T], detached, 0 on masked tokens.
"""

from __future__ import annotations

from typing import Literal

import torch

from engine.algos.masked import masked_mean

Mode = Literal["truncate", "mask"]
Level = Literal["token", "sequence"]
# A ratio outside this band is what the gap metric `outside_share` counts (verl and slime report it too).
BAND = (0.5, 2.0)
# exp() of a log-ratio past this is clamped first (a sequence's summed log-ratio can be large).
LOG_RATIO_CLAMP = 20.0


def rollout_correction(
    *,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    response_mask: torch.Tensor,
    mode: Mode,
    level: Level = "token",
    upper: float = 2.0,
    lower: float = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weights w [B, T] and the gap's statistics (detached scalars):

    - `is_weight_mean`, `is_weight_max`: of the raw weights, per token (token level) or per sequence;
    - `corrected_share`: the share of tokens (or sequences) truncated (mode "truncate") or masked ("mask");
    - `log_ppl_diff`: the mean over sequences of log-perplexity under the rollout minus under the trainer
      (mean token log-prob difference, old - rollout): 0 when the two agree;
    - `kl_k3`: the k3 estimate of KL(behaviour || proximal) over the tokens, exp(r) - 1 - r with r = old - rollout;
    - `outside_share`: the share of tokens whose ratio is outside BAND.
    """
    mask = response_mask.to(old_logp.dtype)
    log_ratio = (old_logp - rollout_logp).detach() * mask  # [B, T], 0 off the response
    token_ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    lengths = mask.sum(-1)  # [B]
    rows = (lengths > 0).to(old_logp.dtype)
    if level == "token":
        raw, unit_mask = token_ratio * mask, mask
    else:
        seq = torch.exp(log_ratio.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B]
        raw, unit_mask = seq * rows, rows
    if mode == "truncate":
        weights, corrected = raw.clamp(max=upper), raw > upper
    else:
        inside = (raw >= lower) & (raw <= upper)
        weights, corrected = raw * inside, ~inside
    if level == "sequence":
        weights = weights[:, None] * mask  # every token of a sequence carries its sequence's weight
    per_row = (log_ratio.sum(-1) / lengths.clamp(min=1)) * rows
    stats = {
        "is_weight_mean": masked_mean(raw, unit_mask),
        "is_weight_max": raw.max() if raw.numel() else torch.zeros(()),
        "corrected_share": masked_mean(corrected.to(old_logp.dtype), unit_mask),
        "log_ppl_diff": per_row.sum() / rows.sum().clamp(min=1),
        "kl_k3": masked_mean(token_ratio - 1 - log_ratio, mask),
        "outside_share": masked_mean(((token_ratio < BAND[0]) | (token_ratio > BAND[1])).to(old_logp.dtype), mask),
    }
    return weights.detach(), {k: v.detach() for k, v in stats.items()}
