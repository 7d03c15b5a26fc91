"""User stages for the pipeline tests (`algorithm.extra_stages`): declarations, not edits of the flow."""

from __future__ import annotations

from engine.batch import Batch
from tasks.graph import stage


@stage(reads=("response_mask",), writes=("brevity",), reward_weight=0.5)
def brevity(batch: Batch) -> Batch:
    """A second reward: 1 for an empty response, falling linearly to 0 at 16 tokens."""
    lengths = batch["response_mask"].sum(-1).float()
    return Batch({"brevity": (1.0 - lengths / 16).clamp(min=0)}, {})


@stage(reads=("response_text", "politeness"), writes=("polite_and_short",))
def reads_a_column_nobody_writes(batch: Batch) -> Batch:
    raise AssertionError("never runs: refused before launch")
