"""RewardModelWorker: a learned reward model in its own pool of ranks (reward.model.placement=pool),
FSDP2-sharded over the pool; frozen, so it has no version, optimizer or checkpoint state."""

from __future__ import annotations

from typing import Any

from engine.batch import Batch
from engine.reward_model import RewardModelScorer, RewardModelSpec, prompts_of
from engine.workers.base import RankWorker, traced


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
