"""Generation: the rollout backends behind one interface (base.py), one file each: hf.py (our decode loop
over the transformers model) and vllm.py (a vLLM engine per rank). `rollout.name` picks one."""

from __future__ import annotations

from typing import Any

from engine.rollout.base import RolloutBackend, RolloutOutput, SamplingParams, response_mask_until_eos
from engine.rollout.hf import HFRollout, draw, sample_next, sampling_logits

BACKENDS = ("hf", "vllm")  # rollout.name

__all__ = ["BACKENDS", "HFRollout", "RolloutBackend", "RolloutOutput", "SamplingParams", "draw", "make_rollout",
           "response_mask_until_eos", "sample_next", "sampling_logits"]


def make_rollout(name: str, model: Any, pad_token_id: int, stop_ids: list[int], **engine: Any) -> RolloutBackend:
    """The rollout backend `name` (rollout.name): hf over `model` (an nn.Module); vllm builds its engine from
    `engine` (engine.rollout.vllm.VLLMRollout's keywords: model_path, cfg, max_model_len, dtype, seed)."""
    if name == "hf":
        return HFRollout(model, pad_token_id, stop_ids)
    if name == "vllm":
        from engine.rollout.vllm import VLLMRollout

        return VLLMRollout(pad_token_id=pad_token_id, stop_ids=stop_ids, **engine)
    raise ValueError(f"rollout.name={name!r}: allowed: {', '.join(BACKENDS)}")
