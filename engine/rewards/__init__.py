"""Rewards: rule functions dispatched on data_source, custom functions, sandboxed code rewards (sandbox.py),
and a learned reward model's model code (reward_model.py, not imported here: it loads transformers).

`score_batch` is the one entry point the reward stage calls (on chunks of a batch, in parallel Ray
tasks); this package itself imports neither Ray nor Prefect.
"""

from engine.rewards.registry import (
    REWARDS,
    RewardBatch,
    RewardSpec,
    load_custom_reward,
    register_reward,
    resolve_reward,
    score_batch,
)
from engine.rewards.sandbox import SandboxJob, SandboxResult, run_sandboxed
from engine.rewards.types import BatchReward, RewardItem, RowFailure, RowReward, SandboxLimits, per_row

__all__ = [
    "REWARDS",
    "BatchReward",
    "RewardBatch",
    "RewardItem",
    "RewardSpec",
    "RowFailure",
    "RowReward",
    "SandboxJob",
    "SandboxLimits",
    "SandboxResult",
    "load_custom_reward",
    "per_row",
    "register_reward",
    "resolve_reward",
    "run_sandboxed",
    "score_batch",
]
