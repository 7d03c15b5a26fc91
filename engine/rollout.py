"""Rollout backends: how a policy rank turns prompts into responses.

The interface is what every backend implements (`hf` here; `vllm` on GPU later): take new weights
after an update, generate with sampling parameters, and sleep/wake around training to give memory back.

Shapes: B prompts (already repeated n times for group sampling), P prompt tokens (left padded),
T = max_new_tokens response tokens (right padded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import GenerationConfig, PreTrainedModel


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off


@dataclass(frozen=True)
class RolloutOutput:
    responses: torch.Tensor  # [B, T] token ids, pad after the end
    response_mask: torch.Tensor  # [B, T] 1 for generated tokens up to and including eos


class RolloutBackend(Protocol):
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, seed: int
    ) -> RolloutOutput: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


class HFRollout:
    """transformers `generate` with a KV cache on an unsharded copy of the policy (CPU or one GPU)."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, stop_ids: list[int]) -> None:
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.stop_ids = sorted(stop_ids)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        # strict: a renamed or missing weight must fail here, not generate from stale values.
        self.model.load_state_dict(state_dict, strict=True)

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, seed: int
    ) -> RolloutOutput:
        """input_ids, attention_mask: [B, P] left padded. Returns [B, T] with T = max_new_tokens."""
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=params.do_sample,
            temperature=params.temperature if params.do_sample else None,
            top_p=params.top_p if params.do_sample else None,
            top_k=(params.top_k or None) if params.do_sample else None,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.stop_ids,
        )
        torch.manual_seed(seed)  # sampling draws from the global generator: seed it per call
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        responses = out[:, input_ids.shape[1] :]  # [B, T'] with T' <= T (stops when all ended)
        responses = _pad_right(responses, params.max_new_tokens, self.pad_token_id)
        return RolloutOutput(responses, response_mask_until_eos(responses, self.stop_ids))

    def sleep(self) -> None:
        """Nothing to release for an in-process transformers model."""

    def wake(self) -> None:
        """Nothing to restore for an in-process transformers model."""


def response_mask_until_eos(responses: torch.Tensor, stop_ids: list[int]) -> torch.Tensor:
    """[B, T] -> [B, T] long mask: 1 up to and including the first stop token, 0 after it."""
    is_eos = torch.isin(responses, torch.tensor(stop_ids, dtype=responses.dtype)).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos  # eos tokens strictly before position t
    return (eos_before == 0).long()


def _pad_right(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    if x.shape[1] >= length:
        return x[:, :length]
    pad = x.new_full((x.shape[0], length - x.shape[1]), value)
    return torch.cat([x, pad], dim=1)
