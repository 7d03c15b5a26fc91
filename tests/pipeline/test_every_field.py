"""Every config field has an effect, or is refused (no setting accepted and ignored).

`EFFECTS` names, for every field of the config (nested ones included, listed by walking the models), how
a value other than the default shows:

- `Run(value, group)`: `rlflow train` with the value, one short iteration of the tiny model, computes
  something else than the same run without it: a buffer's tensors, a metric (timings and memory left
  out), or a file's bytes (weights, trainer state, which files exist). `group` adds the settings the
  field needs (the KL penalty for its estimator, ...); the run without the value is the group's own.
  Two runs of the same config are first checked to fingerprint alike, so a difference is the value's.
  A run costs ~10 s of process and engine starts: a field that acts inside a policy rank (the
  optimizer, the update's layout and loss, LoRA, the rollout's cut) is `Asserted` by a rank set up
  from the config in the test's own process instead (tests/pipeline/test_field_effects.py); for how
  the work is cut (micro-batches, packing) the difference there is the last bits of the weights (the
  sums run in another order), and that the result stays the same to float precision is
  tests/engine/test_gradients.py's claim.
- `Refused(value)`: the config with the value is refused in one line naming the field (its value would
  change nothing there: the critic's settings without a critic, ...).
- `AtStart(value)`: `rlflow train` refuses it before anything is written, in one line naming the field
  (a check that needs the model's files).
- `Asserted(test)`: a named test of the suite asserts what the field changes, where it acts (a fast
  test from the config to the code that reads it: tests/pipeline/test_field_effects.py and others), or
  in a run with a setup of its own (faults, clusters, S3, loggers, vLLM, reward models). The test says
  so with `@pytest.mark.effect_of("<field>", ...)`; checked here: the test function exists, carries that
  marker with the field, sets the field (in its body, or the fixtures, helpers and constants it uses)
  and asserts something. A field's name in a comment or a docstring satisfies none of it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import shutil
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.batch import Batch
from engine.errors import ConfigError
from flows.config import RLConfig, load_config

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent

# One iteration of 2 prompts x 4 responses on one rank, two optimizer steps (Adam's betas act from the
# second), no validation and no export unless a field asks for them.
BASE = ("reward.function={reward}", "model.path={model}", "trainer.total_iterations=1", "trainer.save_every=1",
        "trainer.val_every=0", "trainer.world_size=1", "trainer.export_at_end=false", "data.train_batch_size=2",
        "rollout.n=4", "actor.mini_batch_size=4", "actor.micro_batch_size=4", "data.val_size=8",
        "rollout.max_new_tokens=8", "actor.lr=1e-3")

GROUPS: dict[str, tuple[str, ...]] = {
    "base": (),
    "val": ("trainer.val_every=1",),
    "two": ("trainer.total_iterations=2",),
    "keep": ("trainer.total_iterations=2", "storage.keep_last=1"),
    "onestep": ("actor.mini_batch_size=8",),  # one optimizer step: auto reuses the update's log-probs
    "killed": ("debug.kill_rank_mid_update=0",),  # rank 0 dies in the update: the engine is restarted
    # the controller's error is clipped to +-0.2: the target shows where the KL (that of iteration 1 is 0,
    # ~0.9 in iteration 2) falls on the other side of it than of the default 0.1
    "adaptive": ("trainer.total_iterations=2", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl=adaptive",
                 "algorithm.kl_penalty=k3"),
}


class Run(NamedTuple):
    value: str
    group: str = "base"
    fails: bool = False  # the value makes the run fail where the group's run succeeds


class Refused(NamedTuple):
    value: str


class AtStart(NamedTuple):
    value: str


class Asserted(NamedTuple):
    test: str  # a node id: tests/<file>.py::<function>, marked @pytest.mark.effect_of(<the field>, ...)


MT = "tests/ops/test_multi_turn.py"
RM = "tests/pipeline/test_reward_model.py"
FAULTS = "tests/ops/test_faults.py"
CLUSTER = "tests/ops/test_cluster.py"
FE = "tests/pipeline/test_field_effects.py"

EFFECTS: dict[str, Run | Refused | AtStart | Asserted] = {
    "model.path": Run("{other_model}"),
    "model.tokenizer_path": Run("{other_tokenizer}"),
    "model.dtype": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "model.trust_remote_code": AtStart("true"),
    "model.tiny_seed": AtStart("1"),
    "data.train_files": Run("[{train_file}]"),
    "data.val_files": Run("[{val_file}]", "val"),
    "data.task": Asserted(f"{FE}::test_the_training_prompts_follow_the_data_settings"),
    "data.train_size": Asserted(f"{FE}::test_the_training_prompts_follow_the_data_settings"),
    "data.val_size": Run("9", "val"),
    "data.prompt_key": Refused("question"),
    "data.max_length": Refused("64"),  # RL's; SFT's effect: tests/data/test_conversations.py's long conversations
    "data.max_prompt_length": Asserted(f"{FE}::test_the_training_prompts_follow_the_data_settings"),
    "data.truncation": Asserted(f"{FE}::test_the_training_prompts_follow_the_data_settings"),
    "data.train_batch_size": Asserted(f"{FE}::test_a_steps_prompts_follow_the_batch_and_sampler_settings"),
    "data.val_batch_size": Run("3", "val"),
    "data.shuffle": Asserted(f"{FE}::test_a_steps_prompts_follow_the_batch_and_sampler_settings"),
    "data.seed": Asserted(f"{FE}::test_a_steps_prompts_follow_the_batch_and_sampler_settings"),
    "rollout.name": Asserted("tests/engine/test_vllm_engine.py::test_after_a_sync_vllm_generates_as_the_trained_model"),
    "rollout.n": Asserted(f"{FE}::test_a_steps_prompts_follow_the_batch_and_sampler_settings"),
    "rollout.temperature": Asserted(f"{FE}::test_the_rollout_samples_with_the_rollout_settings"),
    "rollout.top_p": Asserted(f"{FE}::test_the_rollout_samples_with_the_rollout_settings"),
    "rollout.top_k": Asserted(f"{FE}::test_the_rollout_samples_with_the_rollout_settings"),
    "rollout.max_new_tokens": Asserted(f"{FE}::test_a_ranks_rollout_follows_the_rollout_settings"),
    "rollout.partial_tokens": Asserted("tests/ops/test_async.py::test_partial_rollouts_continue_with_the_next_version"),
    "rollout.val_do_sample": Run("false", "val"),
    "rollout.micro_batch_size": Asserted(f"{FE}::test_a_ranks_rollout_follows_the_rollout_settings"),
    "rollout.weights": Asserted(f"{FE}::test_a_ranks_rollout_follows_the_rollout_settings"),
    "rollout.multi_turn.enable": Refused("true"),
    "rollout.multi_turn.tools": Asserted(f"{MT}::test_a_broken_tool_gives_error_observations"),
    "rollout.multi_turn.format": Refused("llama3_json"),
    "rollout.multi_turn.max_turns": Refused("2"),
    "rollout.multi_turn.tool_timeout_s": Refused("1"),
    "rollout.multi_turn.tool_memory_mb": Refused("64"),
    "rollout.multi_turn.max_tool_response_chars": Refused("3"),
    "rollout.multi_turn.env_step_timeout_s": Refused("1"),
    "rollout.multi_turn.env_memory_mb": Refused("64"),
    "rollout.multi_turn.env_error_reward": Refused("-1"),
    "rollout.multi_turn.env_rollout_timeout_s": Refused("60"),
    "rollout.env": Refused("engine.rollout.builtin_envs:GuessNumber"),
    "rollout.agent": Refused("engine.rollout.builtin_agents:guess_number"),
    "rollout.log_prob_max_tokens_per_micro_batch": Asserted(f"{FE}::test_a_ranks_rollout_follows_the_rollout_settings"),
    "rollout.vllm.max_model_len": Refused("64"),
    "rollout.vllm.memory_share": Refused("0.1"),
    "rollout.vllm.kv_cache_gib": Refused("0.5"),
    "rollout.vllm.enforce_eager": Refused("false"),
    "actor.lr": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.weight_decay": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.betas": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.warmup_steps": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.lr_schedule": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.min_lr_ratio": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.grad_clip": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.ppo_epochs": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.mini_batch_size": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.micro_batch_size": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.reshard_after_forward": Refused("false"),
    "actor.grad_sync": Refused("optimizer_step"),
    "actor.max_tokens_per_micro_batch": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.packed_sequences": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.mixed_precision": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.gradient_checkpointing": Asserted(f"{FE}::test_gradient_checkpointing_recomputes_the_layers_in_the_backward"),
    "actor.cpu_offload": Refused("true"),
    "actor.lora.rank": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.lora.alpha": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.lora.dropout": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.lora.target_modules": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.lora.modules_to_save": Asserted("tests/engine/test_lora.py::test_modules_to_save_train_in_full_next_to_the_adapters"),
    "actor.policy_loss": Asserted(f"{FE}::test_the_update_gradient_follows_the_loss_settings"),
    "actor.clip_low": Asserted(f"{FE}::test_the_update_gradient_follows_the_loss_settings"),
    "actor.clip_high": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.clip_ratio_c": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.loss_agg_mode": Asserted(f"{FE}::test_the_update_gradient_follows_the_loss_settings"),
    "actor.use_kl_loss": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.kl_loss_coef": Asserted(f"{FE}::test_the_update_gradient_follows_the_loss_settings"),
    "actor.kl_loss_type": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.entropy_coeff": Asserted(f"{FE}::test_the_update_gradient_follows_the_loss_settings"),
    "actor.share_prompts": Asserted(f"{FE}::test_the_update_follows_the_actor_settings"),
    "actor.rollout_correction.mode": Asserted(f"{FE}::test_the_update_gradient_follows_the_loss_settings"),
    "actor.rollout_correction.level": Refused("sequence"),
    "actor.rollout_correction.upper": Refused("1.5"),
    "actor.rollout_correction.lower": Refused("0.9"),
    "actor.old_log_prob": Run("recompute", "onestep"),
    "critic.lr": Refused("1e-3"),
    "critic.weight_decay": Refused("0.1"),
    "critic.betas": Refused("[0.5,0.9]"),
    "critic.warmup_steps": Refused("2"),
    "critic.lr_schedule": Refused("cosine"),
    "critic.min_lr_ratio": Refused("0.5"),
    "critic.grad_clip": Refused("0.1"),
    "critic.ppo_epochs": Refused("2"),
    "critic.mini_batch_size": Refused("8"),
    "critic.micro_batch_size": Refused("2"),
    "critic.reshard_after_forward": Refused("false"),
    "critic.grad_sync": Refused("optimizer_step"),
    "critic.max_tokens_per_micro_batch": Refused("40"),
    "critic.packed_sequences": Refused("true"),
    "critic.mixed_precision": Refused("bf16"),
    "critic.gradient_checkpointing": Refused("true"),
    "critic.cpu_offload": Refused("true"),
    "critic.lora.rank": Refused("4"),
    "critic.lora.alpha": Refused("8"),
    "critic.lora.dropout": Refused("0.1"),
    "critic.lora.target_modules": Refused("[q_proj]"),
    "critic.lora.modules_to_save": Refused("[score]"),
    "critic.enable": Refused("true"),
    "critic.model_path": Refused("{other_model}"),
    "critic.clip_range_value": Refused("0.1"),
    "critic.loss_agg_mode": Refused("seq-mean-token-mean"),
    "ref.micro_batch_size": Refused("3"),
    "ref.max_tokens_per_micro_batch": Refused("40"),
    "teacher.path": Refused("/x"),  # RL's; distillation's: tests/ops/test_post_training.py
    "teacher.micro_batch_size": Refused("8"),
    "algorithm.dpo_loss": Refused("ipo"),  # RL's; DPO's: tests/algos/test_preference.py, tests/ops/test_post_training.py
    "algorithm.ipo_logratio": Refused("mean"),  # RL's; IPO's: tests/algos/test_preference.py, tests/engine/test_pair_loss.py
    "algorithm.dpo_beta": Refused("0.5"),
    "algorithm.objective": Asserted("tests/ops/test_post_training.py::test_the_conversations_are_the_samplers_and_the_validation_loss_falls"),
    "algorithm.adv_estimator": Asserted("tests/pipeline/test_algorithms.py::test_rloo"),
    "algorithm.gamma": Refused("0.5"),
    "algorithm.lam": Refused("0.5"),
    "algorithm.norm_adv_by_std": Asserted(f"{FE}::test_the_advantages_follow_the_algorithm_settings"),
    "algorithm.use_kl_in_reward": Asserted("tests/pipeline/test_algorithms.py::test_adaptive_kl_in_the_reward_and_remax_baseline"),
    "algorithm.kl_penalty": Asserted(f"{FE}::test_the_advantages_follow_the_algorithm_settings"),
    "algorithm.kl_ctrl": Asserted("tests/pipeline/test_algorithms.py::test_adaptive_kl_in_the_reward_and_remax_baseline"),
    "algorithm.kl_coef": Asserted("tests/pipeline/test_algorithms.py::test_adaptive_kl_in_the_reward_and_remax_baseline"),
    "algorithm.kl_target": Run("100", "adaptive"),
    "algorithm.kl_horizon": Asserted("tests/pipeline/test_algorithms.py::test_adaptive_kl_in_the_reward_and_remax_baseline"),
    "algorithm.filter_groups": Asserted("tests/ops/test_dynamic_sampling.py::test_kept_groups_differ_and_the_sampler_follows_on"),
    "algorithm.max_num_gen_batches": Refused("2"),
    "algorithm.cost_limit": Refused("0.5"),
    "algorithm.lagrange_init": Refused("2.0"),
    "algorithm.lagrange_lr": Refused("0.5"),
    "algorithm.lagrange_max": Refused("3.0"),
    "algorithm.extra_stages": Asserted("tests/pipeline/test_algorithms.py::test_dr_grpo_with_a_user_stage_as_second_reward"),
    "reward.model.path": Asserted(f"{RM}::test_rewards_of_a_reward_model_pool"),
    "reward.model.tokenizer_path": Refused("{other_tokenizer}"),
    "reward.model.dtype": Refused("bfloat16"),
    "reward.model.trust_remote_code": Refused("true"),
    "reward.model.weight": Refused("0.5"),
    "reward.model.micro_batch_size": Refused("3"),
    "reward.model.max_length": Refused("20"),
    "reward.model.placement": Refused("colocated"),
    "reward.model.ranks": Refused("2"),
    "reward.rule_weight": Refused("0.5"),
    "reward.function": Asserted("tests/rewards/test_reward_registry.py::test_custom_reward_from_a_file_path"),
    "reward.cost_function": Refused("{cost}"),
    "reward.chunk_size": Run("3"),
    "reward.sandbox.isolation": Asserted(f"{FE}::test_sandboxed_code_runs_under_the_reward_settings"),
    "reward.sandbox_timeout_s": Asserted(f"{FE}::test_sandboxed_code_runs_under_the_reward_settings"),
    "reward.sandbox_memory_mb": Asserted(f"{FE}::test_sandboxed_code_runs_under_the_reward_settings"),
    "reward.overlong_buffer_len": Asserted("tests/pipeline/test_algorithms.py::test_overlong_shaping_is_in_the_scores"),
    "reward.overlong_penalty_factor": Refused("0.5"),
    "reward.format_weight": Asserted("tests/rewards/test_reasoning_gym_reward.py::"
                                     "test_right_wrong_and_no_answer_with_and_without_the_format_weight"),
    "trainer.project": Refused("other"),
    "trainer.run_id": Asserted("tests/ops/test_credentials.py::test_secret_not_in_prefect"),
    "trainer.total_iterations": Run("2"),
    "trainer.iterations_per_run": Asserted("tests/ops/test_deploy.py::test_continue_lineage_on_schedule"),
    "trainer.save_every": Asserted("tests/pipeline/test_train.py::test_grpo_three_iterations_on_s3"),
    "trainer.val_every": Asserted("tests/pipeline/test_train.py::test_grpo_three_iterations_on_s3"),
    "trainer.world_size": Asserted(f"{FE}::test_the_engines_pools_follow_the_placement_settings"),
    "trainer.max_staleness": Refused("1"),
    "trainer.device": Asserted("tests/test_config.py::test_device_auto_resolves_and_what_is_not_built_is_refused"),
    "trainer.seed": Run("1"),
    "trainer.export_at_end": Run("true"),
    "trainer.export_merged": Refused("true"),
    "trainer.keep_engine": Asserted(f"{CLUSTER}::test_lost_node_mid_update_waits_for_a_replacement"),
    "trainer.max_engine_restarts": Run("0", "killed", fails=True),
    "trainer.stage_timeout_s": Asserted(f"{FE}::test_a_stages_engine_calls_and_retries_follow_the_trainer_settings"),
    "trainer.stage_retry_delays_s": Asserted("tests/ops/test_worker.py::test_a_worker_executes_a_run_and_its_retry_reuses_finished_stages"),
    "trainer.stage_timeouts": Asserted(f"{FAULTS}::test_hung_rank_mid_update_is_restarted"),
    "trainer.capacity_timeout_s": Asserted(f"{CLUSTER}::test_no_capacity_in_time_fails_then_resume_goes_on"),
    "trainer.loggers": Asserted("tests/ops/test_credentials.py::test_secret_not_in_persisted_results_or_logger_files"),
    "trainer.log_dir": Refused("{root}/logs"),
    "storage.root": Asserted("tests/pipeline/test_train.py::test_grpo_three_iterations_on_s3"),
    "storage.endpoint_url": Refused("http://127.0.0.1:9"),
    "storage.region": Refused("eu-west-3"),
    "storage.access_key_id": Refused("AKIAEXAMPLE"),
    "storage.secret_access_key": Refused("hunter2"),
    "storage.shared_fs": Asserted("tests/test_config.py::test_local_storage_on_two_nodes"),
    "storage.keep_last": Run("1", "two"),
    "storage.keep_every": Run("1", "keep"),
    "storage.lease_ttl_s": Run("120"),
    "storage.retry_attempts": Asserted("tests/infra/test_store.py::test_retries_come_from_the_config"),
    "storage.retry_max_wait_s": Asserted("tests/infra/test_store.py::test_retries_come_from_the_config"),
    "storage.connect_timeout_s": Refused("1"),
    "storage.read_timeout_s": Refused("1"),
    "storage.max_concurrency": Asserted("tests/infra/test_store.py::test_max_concurrency_from_the_config"),
    "placement.mode": Asserted(f"{FE}::test_the_engines_pools_follow_the_placement_settings"),
    "placement.rollout_ranks": Refused("2"),
    "placement.sync_bucket_mb": Refused("0.25"),
    "placement.cpus_per_rank": Asserted(f"{FE}::test_the_engines_pools_follow_the_placement_settings"),
    "placement.cpu_kernels": Asserted(f"{FE}::test_the_ranks_environment_follows_the_cpu_kernels"),
    "ray.address": Asserted(f"{FE}::test_rlflow_train_joins_the_configured_ray_cluster"),
    "ray.namespace": Asserted("tests/pipeline/test_every_field.py::test_an_engine_kept_in_its_namespace"),
    "ray.max_concurrent_stages": AtStart("1"),
    "ray.placement": Asserted(f"{CLUSTER}::test_lost_node_mid_update_waits_for_a_replacement"),
    "debug.fail_stage": Asserted("tests/ops/test_async.py::test_failed_then_killed_async_run_resumes_like_the_uninterrupted_one"),
    "debug.fail_times": Asserted("tests/ops/test_async.py::test_failed_then_killed_async_run_resumes_like_the_uninterrupted_one"),
    "debug.fail_iteration": Asserted("tests/ops/test_async.py::test_failed_then_killed_async_run_resumes_like_the_uninterrupted_one"),
    "debug.kill_flow_after": Asserted("tests/ops/test_dynamic_sampling.py::test_failed_then_killed_dynamic_sampling_run_resumes_like_the_uninterrupted_one"),
    "debug.kill_iteration": Asserted(f"{FAULTS}::test_engine_rank_killed_mid_update_then_killed_during_checkpoint_upload"),
    "debug.kill_rank_mid_update": Asserted(f"{FAULTS}::test_engine_rank_killed_mid_update_then_killed_during_checkpoint_upload"),
    "debug.stop_rank_mid_update": Asserted(f"{FAULTS}::test_hung_rank_mid_update_is_restarted"),
    "debug.kill_during_checkpoint": Asserted(f"{FAULTS}::test_engine_rank_killed_mid_update_then_killed_during_checkpoint_upload"),
}


def config_fields(model: type = RLConfig, prefix: str = "") -> list[str]:
    """Every field of the config, nested sections walked (actor.lora.rank, rollout.multi_turn.tools, ...)."""
    out = []
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        annotation = field.annotation
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            out += config_fields(annotation, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def test_every_field_has_an_entry() -> None:
    fields = config_fields()
    assert len(fields) > 150
    missing, stale = sorted(set(fields) - set(EFFECTS)), sorted(set(EFFECTS) - set(fields))
    assert not missing and not stale, f"fields without an entry: {missing}; entries of no field: {stale}"


# -- refused ------------------------------------------------------------------------------------------

PLACEHOLDERS = {"reward": str(HERE / "rewards.py") + ":digit_share", "model": "/nonexistent/model",
                "other_model": "/nonexistent/other", "other_tokenizer": "/nonexistent/tok", "root": "/nonexistent/root",
                "cost": str(HERE / "rewards.py") + ":length_cost"}


@pytest.mark.parametrize("field", [f for f, e in EFFECTS.items() if isinstance(e, Refused)])
def test_refused(field: str) -> None:
    """The base config with the value: one ConfigError line that names the field."""
    entry = EFFECTS[field]
    base = [b.format(**PLACEHOLDERS) for b in BASE] + ["storage.root=/nonexistent/root", "trainer.run_id=r"]
    load_config(None, base)  # the base itself is accepted
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, f"{field}={entry.value.format(**PLACEHOLDERS)}"])
    message = str(err.value)
    assert message.startswith(f"{field}=") and "\n" not in message, message


# -- asserted by a marked test -----------------------------------------------------------------------

def _definitions(path: Path) -> dict[str, ast.AST]:
    """The module-level functions, classes and assignments of the test file `path` and of the conftest.py
    files above it up to tests/: where its fixtures, helpers and constants live."""
    folders = [f for f in (path.parent, *path.parent.parents) if f == TESTS or TESTS in f.parents]
    out: dict[str, ast.AST] = {}
    for file in [*(f / "conftest.py" for f in reversed(folders)), path]:
        if not file.exists():
            continue
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    out.update({n.id: node for n in ast.walk(target) if isinstance(n, ast.Name)})
    return out


def _reached(test: ast.FunctionDef, definitions: dict[str, ast.AST]) -> list[ast.AST]:
    """The test and, transitively, the definitions it names: the fixtures it takes, the helpers it calls,
    the constants it reads."""
    seen, todo, out = {test.name}, list[ast.AST]([test]), list[ast.AST]()
    while todo:
        node = todo.pop()
        out.append(node)
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
            {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
        for name in sorted(names - seen):
            if name in definitions:
                seen.add(name)
                todo.append(definitions[name])
    return out


def _sets(field: str, nodes: list[ast.AST]) -> bool:
    """Whether code (not a docstring or a comment) sets the field: an override `field=...` in a string, a
    keyword argument or a dict key named as the field's last part (a config section built in Python)."""
    leaf = field.rsplit(".", 1)[1]
    for node in nodes:
        docstrings = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for n in ast.walk(node):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings \
                    and f"{field}=" in n.value:
                return True
            if isinstance(n, ast.keyword) and n.arg == leaf:
                return True
            if isinstance(n, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == leaf for k in n.keys):
                return True
    return False


def effect_markers(test: ast.FunctionDef) -> set[str]:
    """The fields a test's `@pytest.mark.effect_of(...)` decorators name."""
    return {arg.value for dec in test.decorator_list if isinstance(dec, ast.Call)
            and ast.unparse(dec.func) == "pytest.mark.effect_of" for arg in dec.args
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}


def _asserts(test: ast.FunctionDef, definitions: dict[str, ast.AST]) -> bool:
    """In the test's own body: an assert statement, pytest.raises, an assert_... helper, or a call of a
    helper of its module that holds an assert statement (`close(got, want)`)."""
    for n in ast.walk(test):
        if isinstance(n, ast.Assert):
            return True
        if isinstance(n, ast.Call) and re.search(r"(^|\.)(assert_\w*|raises)$", ast.unparse(n.func)):
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and isinstance(
                helper := definitions.get(n.func.id), ast.FunctionDef) and any(
                isinstance(m, ast.Assert) for m in ast.walk(helper)):
            return True
    return False


@pytest.mark.parametrize("field", [f for f, e in EFFECTS.items() if isinstance(e, Asserted)])
def test_asserted_by_a_marked_test(field: str) -> None:
    """The named test exists, says with its effect_of marker that it asserts what the field changes,
    sets the field, and asserts."""
    entry = EFFECTS[field]
    assert isinstance(entry, Asserted)
    path, _, name = entry.test.partition("::")
    module = TESTS.parent / path
    tests = {node.name: node for node in ast.walk(ast.parse(module.read_text()))
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}
    assert name in tests, f"{field}: {path} has no test {name}"
    test = tests[name]
    definitions = _definitions(module)
    assert field in effect_markers(test), f"{field}: {entry.test} is not marked @pytest.mark.effect_of({field!r})"
    assert _sets(field, _reached(test, definitions)), f"{field}: {entry.test} does not set it"
    assert _asserts(test, definitions), f"{field}: {entry.test} asserts nothing"


def test_the_checks_of_asserted_cannot_be_met_by_text() -> None:
    """A test that names a field in its docstring, a comment and an unrelated string, without the
    marker, fails every check above; the same test marked, setting it and asserting, passes them."""
    source = '''
import pytest
LIST = ["rollout.top_k"]
def test_mentions() -> None:
    """rollout.top_k=3 changes the draws."""
    print("rollout.top_k", LIST)  # rollout.top_k=3
@pytest.mark.effect_of("rollout.top_k")
def test_sets_and_asserts() -> None:
    assert run(SETTINGS).draws
SETTINGS = ["rollout.top_k=3"]
'''
    tests = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    definitions: dict[str, ast.AST] = {ast.unparse(n.targets[0]): n for n in ast.parse(source).body
                                       if isinstance(n, ast.Assign)}
    mentions, marked = tests["test_mentions"], tests["test_sets_and_asserts"]
    assert not effect_markers(mentions) and not _asserts(mentions, definitions)
    assert not _sets("rollout.top_k", _reached(mentions, definitions))
    assert effect_markers(marked) == {"rollout.top_k"} and _asserts(marked, definitions)
    assert _sets("rollout.top_k", _reached(marked, definitions))


# -- runs ---------------------------------------------------------------------------------------------

VOLATILE = re.compile(r"^timing_s/|_per_s$|^perf/(orchestration_s|peak_rss_gb|throughput|time_per_step)$|receive_s$")
SKIPPED = re.compile(r"(^|/)(run\.json|MANIFEST\.json|\.metadata|extra_rank\d+\.pt|[^/]*\.ref\.json|\.rlflow-lock[^/]*)$"
                     r"|^(trace|logs|debug)/")


def _metrics(text: str) -> str:
    def clean(value: object) -> object:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if not VOLATILE.search(k)}
        return value

    return json.dumps(clean(json.loads(text)), sort_keys=True)


def fingerprint(folder: Path) -> dict[str, str]:
    """What a run computed, by file: a buffer's tensors and columns, a metrics file's values without
    timings and memory, the lease's time to live, any other file's bytes. Files that record when and
    where (run.json holds the config itself, manifests and refs their times) are left out."""
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if SKIPPED.search(rel):
            continue
        if rel.endswith(".parquet"):
            batch = Batch.from_parquet(str(path))
            digest = hashlib.sha256()
            for key in sorted(batch.tensors):
                tensor = batch.tensors[key].contiguous()
                digest.update(f"{key}{tensor.dtype}{tuple(tensor.shape)}".encode())
                digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
            digest.update(json.dumps(batch.columns, sort_keys=True, default=str).encode())
            out[rel] = digest.hexdigest()
        elif rel.startswith("metrics/") or re.search(r"^buffers/.*\.json$", rel):
            out[rel] = _metrics(path.read_text())
        elif rel == "lock.json":
            lock = json.loads(path.read_text())
            ttl = (datetime.fromisoformat(lock["expires"]) - datetime.fromisoformat(lock["renewed"])).total_seconds()
            out[rel] = f"ttl {ttl:g}"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def inputs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What the values name: another model (one weight changed), another tokenizer (another chat
    template), prompt files in verl's layout, another reward."""
    from engine.demo.data import ensure_synthetic_data

    root = tmp_path_factory.mktemp("every-field")
    other = root / "other-model"
    shutil.copytree(tiny_model_dir, other)
    weights = load_file(other / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] * 1.5
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    tokenizer = root / "other-tokenizer"
    tokenizer.mkdir()
    for file in tiny_model_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, tokenizer / file.name)
    template = tokenizer / "chat_template.jinja"
    template.write_text(template.read_text().replace("{{- bos_token -}}", "{{- bos_token + '<|system|>' + 'sort' -}}", 1))
    train, val = ensure_synthetic_data("sort", root / "data", train_size=32, val_size=8, seed=7)
    return {"reward": str(HERE / "rewards.py") + ":digit_share", "model": str(tiny_model_dir),
            "other_model": str(other), "other_tokenizer": str(tokenizer), "train_file": str(train),
            "val_file": str(val), "other_reward": str(HERE / "rewards.py") + ":length_cost",
            "stages": str(HERE / "stages.py"), "root": str(root), "cost": str(HERE / "rewards.py") + ":length_cost"}


class Runs:
    """`rlflow train` per distinct list of settings, once; their fingerprints. A failed run's engine is
    stopped (a failed run keeps it for its resume), so the session's cluster has room for the next."""

    def __init__(self, cli: object, inputs: dict[str, str], root: Path, stopper: object) -> None:
        self.cli, self.inputs, self.root, self.stopper, self.done = cli, inputs, root, stopper, {}

    def __call__(self, *settings: str) -> dict[str, str]:
        key = tuple(s.format(**self.inputs) for s in (*BASE, *settings))
        if key not in self.done:
            run_id = f"f{len(self.done):03d}"
            proc = self.cli("train", *key, f"storage.root={self.root}", f"trainer.run_id={run_id}")  # type: ignore[operator]
            self.done[key] = {**fingerprint(self.root / run_id), "(exit)": str(proc.returncode),
                              "(last error line)": proc.stderr.strip().splitlines()[-1] if proc.returncode else ""}
            if proc.returncode:
                self.stopper("engine", "stop", run_id)  # type: ignore[operator]
        return self.done[key]


@pytest.fixture(scope="module")
def runs(warm_cli: object, inputs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(warm_cli, inputs, tmp_path_factory.mktemp("every-field-runs"), warm_cli)


def differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


@pytest.mark.slow
def test_the_same_settings_fingerprint_alike(runs: Runs, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The base run twice, under its own run id each time: nothing differs, so a difference below is the
    value's."""
    first = runs()
    again = Runs(runs.cli, runs.inputs, tmp_path_factory.mktemp("every-field-again"), runs.stopper)()
    assert first["(exit)"] == "0", first["(last error line)"]
    assert not differences(first, again), differences(first, again)


@pytest.mark.slow
@pytest.mark.parametrize("field", [f for f, e in EFFECTS.items() if isinstance(e, Run)])
def test_a_value_changes_what_the_run_computes(field: str, runs: Runs) -> None:
    entry = EFFECTS[field]
    assert isinstance(entry, Run)
    context = GROUPS[entry.group]
    baseline, changed = runs(*context), runs(*context, f"{field}={entry.value}")
    assert baseline["(exit)"] == "0", baseline["(last error line)"]
    if entry.fails:
        assert changed["(exit)"] != "0", f"{field}={entry.value}: the run did not fail"
    else:
        assert changed["(exit)"] == "0", changed["(last error line)"]
    assert differences(baseline, changed), f"{field}={entry.value} changed nothing the run computes"


@pytest.mark.slow
@pytest.mark.parametrize("field", [f for f, e in EFFECTS.items() if isinstance(e, AtStart)])
def test_refused_at_start(field: str, runs: Runs) -> None:
    """`rlflow train` with the value: one error line naming the field, and nothing written."""
    entry = EFFECTS[field]
    run_id = f"refused-{field.replace('.', '-').replace('_', '-')}"
    args = [s.format(**runs.inputs) for s in BASE] + [f"{field}={entry.value}", f"storage.root={runs.root}",
                                                     f"trainer.run_id={run_id}"]
    proc = runs.cli("train", *args)  # type: ignore[operator]
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith(f"rlflow: error: {field}="), proc.stderr
    assert not (runs.root / run_id).exists()


@pytest.mark.slow
@pytest.mark.effect_of("ray.namespace")
def test_an_engine_kept_in_its_namespace(runs: Runs, cli: object) -> None:
    """ray.namespace: the run's engine actors live there (trainer.keep_engine leaves them after the run);
    `rlflow engine list` shows every namespace, and `rlflow engine stop RUN` finds the run in its own."""
    args = [s.format(**runs.inputs) for s in BASE] + [f"storage.root={runs.root}", "trainer.run_id=kept",
                                                     "trainer.keep_engine=true", "ray.namespace=every-field"]
    proc = runs.cli("train", *args)  # type: ignore[operator]
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = cli("engine", "list")  # type: ignore[operator]
    assert "kept: in Ray namespace every-field (ray.namespace)" in listed.stdout.splitlines(), listed.stdout
    assert any(line.split("│")[1].strip() == "kept" for line in listed.stdout.splitlines() if "│" in line), \
        listed.stdout
    stopped = cli("engine", "stop", "kept")  # type: ignore[operator]
    assert stopped.returncode == 0 and stopped.stdout.strip() == "stopped kept: policy", stopped.stdout


@pytest.mark.slow
def test_no_engine_is_left_behind(runs: Runs) -> None:
    """After this module's runs (one failed on purpose, one kept in another namespace and stopped), no rank
    and no placement group of theirs holds the session's CPUs: the next module's runs must fit."""
    listed = runs.cli("engine", "list")  # type: ignore[operator]
    ours = [f"f{i:03d}" for i in range(len(runs.done))] + ["kept"]
    assert listed.returncode == 0 and not [r for r in ours if re.search(rf"\b{r}\b", listed.stdout)], listed.stdout
