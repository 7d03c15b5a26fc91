"""RewardModelWorker: a learned reward model in its own pool of ranks (reward.model.placement=pool),
FSDP2-sharded over the pool; frozen, so it has no version, optimizer or checkpoint state.
RewardModelScorer is the model in one rank, here and in the policy ranks (reward.model.placement=colocated)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from engine.batch import Batch
from engine.errors import ConfigError
from engine.models.loading import load_tokenizer
from engine.rewards.reward_model import (
    Prompt,
    RewardModelSpec,
    conversation_text,
    encode_conversations,
    load_reward_model,
    prompts_of,
    sequence_scores,
)
from engine.workers.base import RankWorker, traced


class RewardModelScorer:
    """The reward model in one rank, sharded with FSDP2 over the rank's process group."""

    def __init__(self, spec: RewardModelSpec) -> None:
        from engine.workers import fsdp

        self.spec = spec
        self.tokenizer = load_tokenizer(spec.tokenizer_path or spec.path, trust_remote_code=spec.trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            raise ConfigError(f"the reward model's tokenizer ({spec.tokenizer_path or spec.path}) has no pad token")
        self.model = fsdp.shard_model(load_reward_model(spec))

    @torch.no_grad()
    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> torch.Tensor:
        """[B] scores of this rank's rows. Every rank runs as many forwards as the rank with the most
        micro-batches (each forward all-gathers the shards); a rank short of rows runs a dummy one."""
        from engine.workers import fsdp

        texts = [conversation_text(self.tokenizer, p, r) for p, r in zip(prompts, responses)]
        size = self.spec.micro_batch_size
        count = int(fsdp.global_max(float(math.ceil(len(texts) / size))))
        out = []
        for i in range(count):
            chunk = texts[i * size:(i + 1) * size]
            ids, mask = encode_conversations(self.tokenizer, chunk or ["."], self.spec.max_length)
            scores = sequence_scores(self.model, ids, mask)
            if chunk:
                out.append(scores)
        return torch.cat(out) if out else torch.zeros(0)


class RewardModelWorker(RankWorker):
    def __init__(self, *, spec: dict[str, Any], **identity: Any) -> None:
        super().__init__(**identity)
        self.spec = RewardModelSpec.model_validate(spec)

    def setup(self) -> None:
        self.scorer = RewardModelScorer(self.spec)

    @traced
    def score_rm(self, batch: Batch) -> Batch:
        """`rm_score` [B] of this rank's rows: `prompt_json` (the row's prompt) and `response_text`."""
        return Batch({"rm_score": self.scorer.score(prompts_of(batch["prompt_json"]), batch["response_text"])}, {})
