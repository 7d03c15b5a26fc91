"""Each algorithm is a declared list of stages with the columns each reads and writes: the iteration's DAG.
Supervised fine-tuning (algorithm.objective=sft) is two: the iteration's conversations as training rows,
then the update; DPO three: the iteration's preference pairs, the reference's log-probs of both
responses, the update.

The list is built from the config and checked before launch: every column a stage reads must be
written by an earlier stage. GRPO leaves out the critic stages; ReMax adds a greedy-baseline rollout
and its scoring; KL adds the reference log-probs; `algorithm.extra_stages` adds the user's own.
`flows/train.rl_iteration` submits exactly this list: a stage's inputs are the stages that last wrote
each column it reads (`StageSpec.sources`), and stages that call the engine run one at a time, in
the declared order (`StageSpec.after`), because ranks must see the same calls in the same order.
"""

from __future__ import annotations

from engine.algos import get_adv_estimator
from engine.errors import ConfigError
from flows.config import RLConfig
from tasks.graph import StageSpec, load_user_stage

# The prompt columns a rollout writes besides its responses (what the sampler gives, encoded).
PROMPT_COLUMNS = ("input_ids", "attention_mask", "row_index", "group_id", "data_source", "ground_truth",
                  "extra_info")
# rollout.env: what the episodes add (engine.rollout.envs.EnvEpisodes)
ENV_COLUMNS = ("env_token_rewards", "env_reward", "env_errors", "env_steps", "env_prompt", "env_error",
               "prompt_json")  # the last: the data row's prompt, which init(row) read
SCORED = ("response_text", "data_source", "ground_truth", "extra_info")  # what a rule reward looks at
SEQUENCES = ("input_ids", "attention_mask", "responses", "response_mask")  # what a forward pass needs


def stages_for(cfg: RLConfig) -> list[StageSpec]:
    """The stage list of one iteration for this config, wired and checked."""
    if cfg.algorithm.objective == "dpo":  # the iteration's pairs, the reference's log-probs, the update
        from engine.data.preferences import PAIR_COLUMNS

        refs = ("ref_logp", "rejected_ref_logp")
        return wire([StageSpec(name="load_preferences", task="load_preferences", reads=(), buffer="pairs",
                               writes=(*PAIR_COLUMNS, "row_index")),
                     StageSpec(name="compute_ref_logprobs", task="compute_pair_ref_logprobs", reads=PAIR_COLUMNS,
                               writes=refs, buffer="ref_logprob", engine=True),
                     StageSpec(name="update_policy", task="update_policy", engine=True, writes=(),
                               reads=(*PAIR_COLUMNS, *refs))])
    if cfg.algorithm.objective == "sft":  # the iteration's conversations, then the update on them
        return wire([StageSpec(name="load_conversations", task="load_conversations", reads=(), buffer="sft",
                               writes=(*SEQUENCES, "row_index")),
                     StageSpec(name="update_policy", task="update_policy", engine=True, writes=(), reads=SEQUENCES)])
    spec = get_adv_estimator(cfg.algorithm.adv_estimator)
    env = cfg.rollout.episodes is not None  # an agent's episodes fill the same columns
    turns = ("turns", *(ENV_COLUMNS if env else ("tool_calls", "tool_errors"))) if cfg.rollout.multi_turn.enable else ()
    rollout = (*PROMPT_COLUMNS, "prompt_ids", "responses", "response_mask", "rollout_logp", "rollout_version")
    if cfg.rollout.partial_tokens is None:
        stages = [StageSpec(name="generate_rollouts", task="generate_rollouts", reads=(), engine=True, buffer="rollout",
                            writes=(*rollout, "response_text", *turns))]
    else:  # partial rollouts: the first rollout.partial_tokens tokens, then the rest with the next version
        stages = [StageSpec(name="generate_rollouts", task="generate_rollouts", reads=(), engine=True,
                            buffer="rollout_head", writes=(*rollout, "finished")),
                  StageSpec(name="continue_rollouts", task="continue_rollouts", reads=(*rollout, "finished"),
                            engine=True, buffer="rollout", writes=(*rollout, "response_text", "token_version"))]
    if spec.needs_baseline:  # ReMax: one greedy response per prompt, repeated over its group
        stages.append(StageSpec(name="generate_baseline", task="generate_baseline", reads=(), engine=True,
                                buffer="baseline", writes=("baseline_responses", "baseline_response_mask",
                                                           "baseline_response_text")))
    distill = cfg.algorithm.objective == "distill"
    if distill:  # the teacher's log-prob of every sampled token (its reverse KL to the student: the advantage)
        stages.append(StageSpec(name="compute_teacher_logprobs", task="compute_teacher_logprobs", reads=SEQUENCES,
                                writes=("teacher_logp",), buffer="teacher_logprob", engine=True))
    rm = cfg.reward.model.enabled  # a learned reward model: an engine call, on the prompts of the rows
    stages.append(StageSpec(name="score_rewards", task="score_rewards", engine=rm, buffer="reward",
                            reads=(*SCORED, "response_mask", *(["row_index"] if rm else []),
                                   *(["env_reward", "env_token_rewards"] if env else []),
                                   # DAPO's overlong penalty: the responses' lengths (engine.batch.response_lengths)
                                   *(["attention_mask"] if cfg.reward.overlong_buffer_len else [])),
                            writes=("score", "token_scores", *(["rule_score", "rm_score"] if rm else []))))
    if cfg.safe_rl:  # safe RL: the cost of each response, next to its reward
        stages.append(StageSpec(name="score_costs", task="score_costs", reads=SCORED, writes=("cost",),
                                buffer="cost"))
    if spec.needs_baseline:
        stages.append(StageSpec(name="score_baseline", task="score_baseline", buffer="baseline_reward",
                                reads=("baseline_response_text", "data_source", "ground_truth", "extra_info"),
                                writes=("baseline_score",)))
    extra_scores = []
    for ref in cfg.algorithm.extra_stages:
        _, declared = load_user_stage(ref)
        name = ref.rpartition(":")[2]
        stages.append(StageSpec(name=name, task="user", reads=declared.reads, writes=declared.writes,
                                buffer=name, function=ref, reward_weight=declared.reward_weight))
        if declared.reward_weight is not None:
            extra_scores += list(declared.writes)
    if cfg.needs_old_logp:
        stages.append(StageSpec(name="compute_old_logprobs", task="compute_old_logprobs", reads=SEQUENCES,
                                writes=("old_logp", "entropy"), buffer="old_logprob", engine=True))
    if cfg.needs_ref:
        stages.append(StageSpec(name="compute_ref_logprobs", task="compute_ref_logprobs", reads=SEQUENCES,
                                writes=("ref_logp",), buffer="ref_logprob", engine=True))
    if cfg.critic.enable:
        stages.append(StageSpec(name="compute_values", task="compute_values", reads=SEQUENCES, writes=("values",),
                                buffer="values", engine=True))
    # The advantage buffer holds everything the updates read, so a replay needs it alone.
    corrected = cfg.rollout_correction_mode != "none"  # the update corrects by the rollout's own log-probs
    carried = [c for c, on in (("old_logp", cfg.needs_old_logp), ("ref_logp", cfg.needs_ref),
                               ("values", cfg.critic.enable), ("rollout_logp", corrected)) if on]
    adv_reads = [*SEQUENCES, "row_index", "group_id", "token_scores", *carried, *extra_scores,
                 *(["teacher_logp", *([] if corrected else ["rollout_logp"])] if distill else [])]
    if spec.needs_baseline:
        adv_reads.append("baseline_score")
    if cfg.safe_rl:
        adv_reads.append("cost")
    stages.append(StageSpec(name="compute_advantages", task="compute_advantages", reads=tuple(adv_reads),
                            writes=(*SEQUENCES, "row_index", "group_id", "token_scores", *carried,
                                    "token_rewards", "adv", "returns"), buffer="advantage"))
    if cfg.critic.enable:
        stages.append(StageSpec(name="update_critic", task="update_critic", engine=True, writes=(),
                                reads=(*SEQUENCES, "values", "returns")))
    actor_reads = [*SEQUENCES, "adv", *(["old_logp"] if cfg.needs_old_logp else []),
                   *(["ref_logp"] if cfg.actor.use_kl_loss else []), *(["rollout_logp"] if corrected else [])]
    stages.append(StageSpec(name="update_policy", task="update_policy", engine=True, writes=(),
                            reads=tuple(actor_reads)))
    if cfg.placement.mode == "split":  # the new weights to the rollout pool
        stages.append(StageSpec(name="sync_weights", task="sync_weights", engine=True, reads=(), writes=()))
    return wire(stages)


def wire(stages: list[StageSpec]) -> list[StageSpec]:
    """Each stage's `sources` (the last earlier writer of every column it reads) and `after` (the
    previous engine stage); ConfigError for a column no earlier stage writes, or a name used twice."""
    writer: dict[str, str] = {}
    previous_engine: str | None = None
    wired = []
    seen: set[str] = set()
    for stage in stages:
        if stage.name in seen:
            raise ConfigError(f"two stages are named {stage.name!r}: stage names must be unique in an iteration")
        seen.add(stage.name)
        missing = [c for c in stage.reads if c not in writer]
        if missing:
            raise ConfigError(f"stage {stage.name} reads {', '.join(missing)}, which no earlier stage writes "
                              f"(stages: {' -> '.join(s.name for s in stages)})")
        sources: dict[str, list[str]] = {}
        for column in stage.reads:
            sources.setdefault(writer[column], []).append(column)
        after = (previous_engine,) if stage.engine and previous_engine and previous_engine not in sources else ()
        wired.append(stage.model_copy(update={"sources": {k: tuple(v) for k, v in sources.items()}, "after": after}))
        for column in stage.writes:
            writer[column] = stage.name
        if stage.engine:
            previous_engine = stage.name
    return wired
