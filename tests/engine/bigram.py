"""A causal LM whose logits are free parameters: logits[b, j] = table[input_ids[b, j]].

The update's gradient with respect to a table row is its gradient with respect to one position's logits,
so tests of what a loss setting changes (rollout correction, the pair loss, the every-field effects) can
run PolicyWorker.gradients on it and compare with a gradient written out by hand.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn


class Bigram(nn.Module):
    def __init__(self, vocab: int, seed: int = 0) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)))

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])
