"""The rollout backend `rollout.name` picks: hf (our decode loop over the transformers model) or vllm
(a vLLM engine per rank, imported only when picked)."""

from __future__ import annotations

from typing import Any

from engine.rollout.base import RolloutBackend
from engine.rollout.hf import HFRollout

BACKENDS = ("hf", "vllm")  # rollout.name


def make_rollout(name: str, model: Any, pad_token_id: int, stop_ids: list[int], **engine: Any) -> RolloutBackend:
    """The rollout backend `name` (rollout.name): hf over `model` (an nn.Module); vllm builds its engine from
    `engine` (engine.rollout.vllm.VLLMRollout's keywords: model_path, cfg, max_model_len, dtype, seed)."""
    if name == "hf":
        return HFRollout(model, pad_token_id, stop_ids)
    if name == "vllm":
        from engine.rollout.vllm import VLLMRollout

        return VLLMRollout(pad_token_id=pad_token_id, stop_ids=stop_ids, **engine)
    raise ValueError(f"rollout.name={name!r}: allowed: {', '.join(BACKENDS)}")
