"""The interface every rollout backend implements (engine/rollout/hf.py, engine/rollout/vllm.py): take
new weights after an update, generate with sampling parameters, sleep/wake around training.

Shapes: B prompts (already repeated n times for group sampling), P prompt tokens (left padded),
T = max_new_tokens response tokens (right padded).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch


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
    logp: torch.Tensor  # [B, T] float32 log-prob of each token under the distribution it was drawn from
    #                     (logits / temperature, then top-k and top-p: the behaviour policy); 0 after the end


class RolloutBackend(Protocol):
    """What a policy or rollout rank holds (rollout.name picks the class: engine/rollout/__init__.py)."""

    stop_ids: list[int]  # the tokens that end a response (a multi-turn turn ends at one too)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> int:
        """New weights, as (name, full tensor) pairs under the transformers model's names, consumed one at a
        time (a generator may gather each one from the FSDP shards as it is asked for it): all of them, or
        with `partial` a part (LoRA on the hf backend: the adapters). Returns the bytes taken."""
        ...

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, seed: int
    ) -> RolloutOutput:
        """input_ids, attention_mask: [B, P] left padded -> [B, T] with T = params.max_new_tokens; the
        same (weights, inputs, params, seed) give the same tokens."""
        ...

    def sleep(self) -> None:
        """Before the update: give back what generation holds (vLLM: its KV cache)."""
        ...

    def wake(self) -> None:
        """After the update, before the new weights are loaded."""
        ...


def response_mask_until_eos(responses: torch.Tensor, stop_ids: list[int]) -> torch.Tensor:
    """[B, T] -> [B, T] long mask: 1 up to and including the first stop token, 0 after it."""
    is_eos = torch.isin(responses, torch.tensor(stop_ids, dtype=responses.dtype)).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos  # eos tokens strictly before position t
    return (eos_before == 0).long()
