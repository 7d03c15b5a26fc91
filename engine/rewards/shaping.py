"""Reward shaping applied to every score of the reward stage, after the rule or model reward."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's overlong reward shaping (Yu et al. 2025, arXiv 2503.14476, eq. 13), per response of `lengths`
    tokens: 0 up to `max_new_tokens - buffer_len` tokens, then falling linearly to `-factor` at
    `max_new_tokens`."""
    start = max_new_tokens - buffer_len
    return torch.clamp(-(lengths.to(torch.float32) - start) / buffer_len * factor, max=0.0)
