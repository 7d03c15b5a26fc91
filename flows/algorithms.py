"""Each algorithm is a declared list of stages with the columns each reads and writes.

The list is built from the config and checked before launch: every column a stage reads must be
written by an earlier stage (or be a prompt column). GRPO leaves out the critic stages; ReMax adds a
greedy-baseline rollout; KL adds the reference log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.algos import get_adv_estimator
from engine.errors import ConfigError
from flows.config import RLConfig

PROMPT_COLUMNS = ("input_ids", "attention_mask", "row_index", "data_source", "ground_truth")


@dataclass(frozen=True)
class Stage:
    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]


ROLLOUT = Stage(
    "generate_rollouts",
    ("input_ids", "attention_mask"),
    ("responses", "response_mask", "group_id", "prompt_ids"),
)
BASELINE = Stage("generate_baseline", ("input_ids", "attention_mask"), ("baseline_responses",))
REWARD = Stage("score_rewards", ("responses", "data_source", "ground_truth"), ("token_scores",))
BASELINE_REWARD = Stage(
    "score_baseline", ("baseline_responses", "data_source", "ground_truth"), ("baseline_score",)
)
OLD_LOGP = Stage("compute_old_logprobs", ("responses", "response_mask"), ("old_logp", "entropy"))
REF_LOGP = Stage("compute_ref_logprobs", ("responses", "response_mask"), ("ref_logp",))
VALUES = Stage("compute_values", ("responses", "response_mask"), ("values",))
UPDATE_CRITIC = Stage("update_critic", ("values", "returns", "response_mask"), ())
CHECKPOINT = Stage("save_checkpoint", (), ())


def stages_for(cfg: RLConfig) -> list[Stage]:
    """The stage list of one iteration for this config, checked."""
    spec = get_adv_estimator(cfg.algorithm.adv_estimator)
    stages = [ROLLOUT]
    if spec.needs_baseline:
        stages.append(BASELINE)
    stages.append(REWARD)
    if spec.needs_baseline:
        stages.append(BASELINE_REWARD)
    if cfg.needs_old_logp:
        stages.append(OLD_LOGP)
    if cfg.needs_ref:
        stages.append(REF_LOGP)
    if cfg.critic.enable:
        stages.append(VALUES)
    adv_reads = ["token_scores", "response_mask", "group_id"]
    if spec.needs_values:
        adv_reads.append("values")
    if spec.needs_baseline:
        adv_reads.append("baseline_score")
    if cfg.algorithm.use_kl_in_reward:
        adv_reads += ["old_logp", "ref_logp"]
    stages.append(Stage("compute_advantages", tuple(adv_reads), ("token_rewards", "adv", "returns")))
    if cfg.critic.enable:
        stages.append(UPDATE_CRITIC)
    actor_reads = (["old_logp"] if cfg.needs_old_logp else []) + ["adv", "response_mask"]
    actor_reads += ["ref_logp"] if cfg.actor.use_kl_loss else []
    stages.append(Stage("update_policy", tuple(actor_reads), ()))
    check_stages(stages)
    return stages


def check_stages(stages: list[Stage]) -> None:
    """Refuse a stage that reads a column no earlier stage wrote."""
    written = set(PROMPT_COLUMNS)
    for stage in stages:
        missing = [c for c in stage.reads if c not in written]
        if missing:
            raise ConfigError(
                f"stage {stage.name} reads {', '.join(missing)}, which no earlier stage writes "
                f"(stages: {' -> '.join(s.name for s in stages)})"
            )
        written.update(stage.writes)
