"""The run config: the sections of every layer composed, loaded from YAML, overridden with dotted keys.

    cfg = load_config("configs/tiny_grpo.yaml", ["actor.lr=1e-5", "algorithm.adv_estimator=gae"])

Every error — unknown key, wrong type, out-of-range value, sections that disagree — is raised as one
`ConfigError` whose message names the key, the value and what is allowed, before anything starts.
"""

from __future__ import annotations

import hashlib
import json
import re
import reprlib
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.config import (
    DAY_S,
    MAX_ITERATIONS,
    MAX_RANKS,
    SEED_MAX,
    WEEK_S,
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    ModelConfig,
    PlacementConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    Section,
    TeacherConfig,
    comma_list,
)
from engine.errors import ConfigError
from flows.loggers import LoggerName
from infra.config import RayConfig, StorageConfig
from infra.errors import InfraError
from infra.store import URL_USERINFO, mask_url_credentials
from tasks.faults import FaultConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_grpo.yaml"
SFT_CONFIG = DEFAULT_CONFIG.with_name("tiny_sft.yaml")  # `rlflow sft`'s default

StageSeconds = Annotated[float, Field(ge=1, le=WEEK_S)]  # a stage's engine call may wait up to a week
RetryDelay = Annotated[float, Field(ge=0, le=DAY_S)]


class TrainerConfig(Section):
    """The run: its length, checkpoints, validation, ranks, device, seed, loggers and recovery."""

    project: str = "rlflow"
    run_id: str | None = Field(None, description="default: <project>-<timestamp>")
    total_iterations: int = Field(20, gt=0, le=MAX_ITERATIONS)
    iterations_per_run: int | None = Field(None, gt=0, le=MAX_ITERATIONS, description="a scheduled run does "
                                            "this many")
    save_every: int = Field(10, gt=0, le=MAX_ITERATIONS)
    val_every: int = Field(5, ge=0, le=MAX_ITERATIONS, description="0: no validation")
    world_size: int = Field(
        2, gt=0, le=MAX_RANKS, description="policy ranks (processes); with placement.mode=split, the training "
        "pool's")
    max_staleness: int = Field(
        0, ge=0, le=64, description="k: the rollout of iteration i generates with the weights of version "
        "i-1-k (0: on-policy). k >= 1 needs placement.mode=split, and the rollout of i+1 runs while i "
        "updates; the update corrects the gap (actor.rollout_correction)")
    device: str = Field("cpu", pattern=r"^(cpu|cuda|auto)$")
    seed: int = Field(0, ge=0, le=SEED_MAX)
    export_at_end: bool = True
    export_merged: bool = Field(False, description="LoRA: the export also writes the base model with the adapters "
                                "merged in (plain transformers weights) under export/step_N_merged")
    keep_engine: bool = Field(False, description="leave the engine actors running after the run")
    max_engine_restarts: int = Field(
        2, ge=0, le=100, description="times a run restarts a failed engine and goes on")
    stage_timeout_s: float | None = Field(
        None, ge=1, le=WEEK_S, description="an engine call of a stage that makes no progress this long "
        "declares the engine hung: it is restarted, restored and replayed, and the iteration runs again; "
        "default: 1 ms per token of the iteration's batch (completions x (data.max_prompt_length + "
        "rollout.max_new_tokens)), at least 1800 s")
    stage_timeouts: dict[str, StageSeconds] = Field(
        default_factory=dict, max_length=64, description="per stage name, instead of stage_timeout_s (for "
        "example {update_policy: 600}); a name that is not a stage of the run is refused with the list of its "
        "stages")
    stage_retry_delays_s: list[RetryDelay] = Field(
        default_factory=lambda: [2.0, 10.0], max_length=10, description="a failed stage is retried once per "
        "entry, after that many seconds (default: a storage or Ray hiccup, then a longer pause); [] retries "
        "none. A stage failed past its retries fails the flow run: Retry it in the UI, or resume")
    capacity_timeout_s: float = Field(
        600.0, ge=1, le=WEEK_S, description="an engine restarted after a lost node waits this long for the "
        "cluster to have room for its ranks, then the run fails (resume it once nodes are back)")
    loggers: list[LoggerName] = Field(
        default_factory=list, max_length=len(get_args(LoggerName)),
        description="metric loggers besides metrics.jsonl: tensorboard, wandb (offline), mlflow (local "
        "SQLite); a list or comma-separated; needs pip install 'rlflow[loggers]'",
    )
    log_dir: str | None = Field(
        None,
        description="local folder of the loggers' files, one subfolder per run; default: "
        "<storage.root>/<run_id>/logs, or ./runs/<run_id>/logs when storage is S3",
    )

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str | None) -> str | None:
        from infra.layout import check_run_id

        if value is not None:
            try:
                check_run_id(value)
            except InfraError as err:
                raise ValueError(str(err)) from None
        return value

    @field_validator("loggers", mode="before")
    @classmethod
    def _split_loggers(cls, value: Any) -> Any:
        return comma_list(value)  # `trainer.loggers=tensorboard,wandb` on the command line

    @field_validator("loggers")
    @classmethod
    def _unique_loggers(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("each logger at most once")
        return value

    @field_validator("log_dir")
    @classmethod
    def _local_log_dir(cls, value: str | None) -> str | None:
        if value is not None and "://" in value and not value.startswith("file://"):
            raise ValueError("must be a local folder: the loggers write local files (storage.root may be S3)")
        return value


class RLConfig(BaseModel):
    """The whole run config. Sections are owned by their layers; the checks across sections live here."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    debug: FaultConfig = Field(default_factory=FaultConfig)

    @model_validator(mode="before")
    @classmethod
    def _printable_text(cls, data: Any) -> Any:
        """Every string given to the config (names, paths, URLs, code references; list items and mapping keys
        too) is printable text of at most MAX_TEXT characters, and a URL holds no credentials: a config is shown
        in terminals, logs and the UI, and stored with the run. Checked on the input, before the fields' own
        checks, whose messages echo values."""
        for key, value, text in _strings(cls, data, ""):
            problem = text_problem(text)
            if problem is not None:
                raise _cross(key, value, problem)
        return data

    @model_validator(mode="after")
    def _sections_agree(self) -> RLConfig:
        from engine.algos import get_adv_estimator

        ranks = self.trainer.world_size
        if self.algorithm.objective == "distill":
            self._check_distill()
        elif _changed_any(self.teacher):
            key, value = next(iter(_changed(self.teacher, "teacher")))
            raise _cross(key, value, "is a setting of on-policy distillation's teacher: it needs "
                         "algorithm.objective=distill")
        if self.algorithm.objective in ("sft", "dpo"):
            self._check_offline()
        elif _differs_from_default(self.data, "max_length"):
            raise _cross("data.max_length", self.data.max_length, "bounds SFT's conversations and DPO's pairs: it "
                         "needs algorithm.objective=sft or dpo (a rollout's prompts: data.max_prompt_length)")
        if self.algorithm.objective != "dpo":
            for key in ("dpo_loss", "dpo_beta", "ipo_logratio"):
                if _differs_from_default(self.algorithm, key):
                    raise _cross(f"algorithm.{key}", getattr(self.algorithm, key), "is a setting of DPO: it needs "
                                 "algorithm.objective=dpo")
        elif self.algorithm.dpo_loss != "ipo" and _differs_from_default(self.algorithm, "ipo_logratio"):
            raise _cross("algorithm.ipo_logratio", self.algorithm.ipo_logratio, "is a setting of IPO's loss: it "
                         "needs algorithm.dpo_loss=ipo")
        per_iter = self.rows_per_iteration
        if per_iter % ranks:
            raise _cross(
                "data.train_batch_size",
                self.data.train_batch_size,
                (f"train_batch_size x rollout.n ({per_iter})" if self.algorithm.objective in ("rl", "distill") else
                 "its rows") + f" must be divisible by trainer.world_size ({ranks})",
            )
        for section in ("actor", "critic"):
            mini = getattr(self, section).mini_batch_size
            if mini % ranks:
                raise _cross(
                    f"{section}.mini_batch_size",
                    mini,
                    f"must be divisible by trainer.world_size ({ranks})",
                )
        spec = get_adv_estimator(self.algorithm.adv_estimator)
        if spec.group_based and self.rollout.n < 2 and self.algorithm.objective == "rl":
            raise _cross(
                "rollout.n",
                self.rollout.n,
                f"algorithm.adv_estimator={spec.name} compares responses within a group: needs rollout.n >= 2",
            )
        if self.trainer.export_merged and not self.actor.lora.enabled:
            raise _cross("trainer.export_merged", True, "merges LoRA adapters: it needs actor.lora.rank > 0 (a full "
                         "fine-tuning export is the full weights already)")
        if self.critic.lora.enabled and not self.critic.enable:
            raise _cross("critic.lora.rank", self.critic.lora.rank, "needs critic.enable=true")
        k = self.trainer.max_staleness
        if k and self.placement.mode != "split":
            raise _cross("trainer.max_staleness", k, "needs placement.mode=split: colocated ranks generate and "
                         "train in turn, so a rollout cannot run while an update does")
        # Only a value other than the default is refused: a saved run.json writes every default out, and
        # a default changes nothing either way.
        if self.placement.mode == "colocated":
            for key in ("rollout_ranks", "sync_bucket_mb"):
                if _differs_from_default(self.placement, key):
                    raise _cross(f"placement.{key}", getattr(self.placement, key), "is a setting of the rollout "
                                 "pool: it needs placement.mode=split")
        self._check_rollout_correction()
        self._check_vllm()
        buffer = self.reward.overlong_buffer_len
        if buffer and buffer >= self.rollout.max_new_tokens:
            raise _cross("reward.overlong_buffer_len", buffer, f"must be below rollout.max_new_tokens "
                         f"({self.rollout.max_new_tokens}): the penalty starts that many tokens before the limit")
        if not buffer and _differs_from_default(self.reward, "overlong_penalty_factor"):
            raise _cross("reward.overlong_penalty_factor", self.reward.overlong_penalty_factor,
                         "scales the overlong penalty: it needs reward.overlong_buffer_len > 0")
        self._check_safety()
        self._check_multi_turn()
        self._check_partial(spec.needs_baseline)
        self._check_reward_model()
        if self.algorithm.filter_groups:
            self._check_dynamic_sampling(spec.name)
        elif _differs_from_default(self.algorithm, "max_num_gen_batches"):
            raise _cross("algorithm.max_num_gen_batches", self.algorithm.max_num_gen_batches,
                         "bounds dynamic sampling: it needs algorithm.filter_groups=true")
        if k and self.algorithm.kl_ctrl == "adaptive":
            raise _cross("trainer.max_staleness", k, "cannot be combined with algorithm.kl_ctrl=adaptive (the "
                         "coefficient of iteration i comes from i-1, which is still running); use fixed")
        if spec.needs_values and not self.critic.enable:
            raise _cross(
                "algorithm.adv_estimator",
                spec.name,
                "needs a critic for its values: set critic.enable=true, or use a critic-free estimator",
            )
        if self.critic.enable and not spec.needs_values:
            raise _cross("critic.enable", True, f"trains a critic whose values nothing reads: "
                         f"algorithm.adv_estimator={spec.name} does not use values (gae does)")
        self._check_unread_settings(spec)
        self._check_inert_sections()
        return self

    @property
    def rows_per_iteration(self) -> int:
        """The training rows of an iteration: train_batch_size prompts x rollout.n responses (SFT: conversations)."""
        return self.data.train_batch_size * (self.rollout.n if self.algorithm.objective in ("rl", "distill") else 1)

    def _check_distill(self) -> None:
        """algorithm.objective=distill: a teacher, and none of what its advantage replaces (the estimator,
        the critic, the KL in the reward, dynamic sampling); what is not built with it is refused."""
        if self.teacher.path is None:
            raise _cross("algorithm.objective", "distill", "needs teacher.path, the model that scores the "
                         "student's tokens")
        algo = self.algorithm
        replaced = [*((f"algorithm.{k}", getattr(algo, k)) for k in ("adv_estimator", "gamma", "lam", "norm_adv_by_std",
                                                                    "use_kl_in_reward", "filter_groups")
                      if _differs_from_default(algo, k)),
                    *(("critic.enable", True),) * self.critic.enable]
        if replaced:
            key, value = replaced[0]
            raise _cross(key, value, "is replaced under algorithm.objective=distill: the advantage of each token is "
                         "its reverse KL to the teacher, negated")
        for key, value in (("rollout.multi_turn.enable", self.rollout.multi_turn.enable or None),
                           ("rollout.partial_tokens", self.rollout.partial_tokens)):
            if value is not None:
                raise _cross(key, value, "is not built with algorithm.objective=distill")
        # The student's log-prob (rollout_logp) is over the distribution it sampled from, truncated by top-k
        # and top-p; the teacher's is over its full one: their difference would not estimate the reverse KL.
        for key in ("top_k", "top_p"):
            if _differs_from_default(self.rollout, key):
                raise _cross(f"rollout.{key}", getattr(self.rollout, key), "truncates the student's sampling "
                             "distribution and the teacher's log-probs are over its full one, so the advantage "
                             "would be biased: algorithm.objective=distill needs rollout.top_k=0 and rollout.top_p=1")

    def _check_offline(self) -> None:
        """algorithm.objective=sft or dpo generates, scores and compares nothing: a setting of the rollout,
        the reward, the critic, the advantage or the policy loss is refused (and of the reference under SFT:
        DPO's reference is RL's), as are the prompts' own data settings and the split placement."""
        objective = self.algorithm.objective
        inert = [*_changed(self.rollout, "rollout"), *_changed(self.reward, "reward"), *_changed(self.critic, "critic"),
                 *(_changed(self.ref, "ref") if objective == "sft" else ()),
                 *((k, v) for k, v in _changed(self.algorithm, "algorithm")
                   if k not in ("algorithm.objective", "algorithm.dpo_loss", "algorithm.dpo_beta",
                                "algorithm.ipo_logratio")),
                 *((k, v) for k, v in _changed(self.actor, "actor") if k.removeprefix("actor.").split(".")[0] in SFT_INERT_ACTOR),
                 *((k, v) for k, v in _changed(self.data, "data") if k in ("data.prompt_key", "data.max_prompt_length"))]
        if inert:
            key, value = inert[0]
            raise _cross(key, value, f"is a setting of RL (rollouts, rewards, advantages, the policy loss); "
                         f"algorithm.objective={objective} trains on data.train_files' "
                         f"{'conversations' if objective == 'sft' else 'preference pairs'} "
                         f"(configs/tiny_{objective}.yaml is a config for it)")
        if self.data.truncation in ("left", "right"):
            raise _cross("data.truncation", self.data.truncation, f"algorithm.objective={objective} drops a "
                         "conversation over data.max_length (drop) or refuses it (error); cutting one is not built")
        if self.placement.mode == "split":
            raise _cross("placement.mode", "split", f"puts the rollout on its own pool; algorithm.objective={objective} "
                         "has no rollout (colocated)")
        if objective == "dpo" and self.actor.max_tokens_per_micro_batch is not None:
            raise _cross("actor.max_tokens_per_micro_batch", self.actor.max_tokens_per_micro_batch, "is not built with "
                         "algorithm.objective=dpo (a pair's two responses are one row)")

    def _check_inert_sections(self) -> None:
        """A section, or a setting, that this config never runs is refused (its value would change nothing):
        the critic without critic.enable, LoRA settings without lora.rank, CPU offload on the CPU, the
        reference's batching without a reference, loggers' settings without a logger, data settings of
        the other data source, and faults' settings without their fault."""
        critic = self.critic
        if not critic.enable:
            for key in type(critic).model_fields:
                if key not in ("enable", "lora") and _differs_from_default(critic, key):
                    raise _cross(f"critic.{key}", getattr(critic, key), "is a setting of the critic: it needs "
                                 "critic.enable=true")
            for key in type(critic.lora).model_fields:
                if _differs_from_default(critic.lora, key):
                    raise _cross(f"critic.lora.{key}", getattr(critic.lora, key), "is a setting of the critic: it "
                                 "needs critic.enable=true")
        roles = ("actor", "critic") if critic.enable else ("actor",)
        for role in roles:
            lora = getattr(self, role).lora
            if not lora.enabled:
                for key in ("alpha", "dropout", "target_modules", "modules_to_save"):
                    if _differs_from_default(lora, key):
                        raise _cross(f"{role}.lora.{key}", getattr(lora, key), f"is a setting of LoRA adapters: it "
                                     f"needs {role}.lora.rank > 0")
            if self.trainer.device == "cpu" and getattr(self, role).cpu_offload:
                raise _cross(f"{role}.cpu_offload", True, "moves sharded parameters, gradients and optimizer state "
                             "to host memory, where a CPU run (trainer.device=cpu) holds them already")
        if not self.needs_ref:
            for key in type(self.ref).model_fields:
                if _differs_from_default(self.ref, key):
                    raise _cross(f"ref.{key}", getattr(self.ref, key), "batches the reference policy's forward: "
                                 "it needs a KL term (actor.use_kl_loss or algorithm.use_kl_in_reward)")
        for role in roles:
            optim = getattr(self, role)
            if optim.lr_schedule == "constant" and _differs_from_default(optim, "min_lr_ratio"):
                raise _cross(f"{role}.min_lr_ratio", optim.min_lr_ratio, f"is the floor of a decaying rate: "
                             f"{role}.lr_schedule=constant does not decay (cosine or linear do)")
        for role in roles:
            optim = getattr(self, role)
            if self.trainer.world_size == 1:
                for key in ("reshard_after_forward", "grad_sync"):
                    if _differs_from_default(optim, key):
                        raise _cross(f"{role}.{key}", getattr(optim, key), "sets how FSDP2 gathers and reduces across "
                                     "ranks; trainer.world_size=1 holds the whole model on one rank")
        actor = self.actor
        completions = self.data.train_batch_size * self.rollout.n
        if actor.old_log_prob == "recompute" and not actor.model_copy(update={"old_log_prob": "auto"}).reuses_update_logp(
                completions, self.algorithm.use_kl_in_reward):
            raise _cross("actor.old_log_prob", "recompute", "is what auto does in this config (more than one optimizer "
                         "step per iteration, or the KL in the reward): the old log-prob pass runs either way")
        if self.ray.address is not None and _differs_from_default(self.ray, "max_concurrent_stages"):
            raise _cross("ray.max_concurrent_stages", self.ray.max_concurrent_stages, "sizes the stage slots of the "
                         "local stack's Ray head; ray.address is an external cluster (its own resources)")
        trainer = self.trainer
        if (trainer.run_id is not None and _differs_from_default(trainer, "project")
                and not {"wandb", "mlflow"} & set(trainer.loggers)):
            raise _cross("trainer.project", trainer.project, "names the default run id (trainer.run_id is set) "
                         "and the W&B project or MLflow experiment (trainer.loggers has neither)")
        if self.trainer.log_dir is not None and not self.trainer.loggers:
            raise _cross("trainer.log_dir", self.trainer.log_dir, "is the folder of the loggers' files: it needs "
                         "trainer.loggers (tensorboard, wandb, mlflow)")
        data = self.data
        if not data.train_files and _differs_from_default(data, "prompt_key"):
            raise _cross("data.prompt_key", data.prompt_key, "names the prompt column of data.train_files; the "
                         "synthetic data.task has 'prompt'")
        if data.train_files and _differs_from_default(data, "train_size"):
            raise _cross("data.train_size", data.train_size, "sizes the synthetic data.task; data.train_files "
                         "are read instead")
        storage = self.storage
        s3 = storage.root.startswith(("s3://", "s3a://"))
        for key in ("shared_fs",) if s3 else ("endpoint_url", "region", "access_key_id", "secret_access_key",
                                              "connect_timeout_s", "read_timeout_s"):
            if _differs_from_default(storage, key):
                raise _cross(f"storage.{key}", getattr(storage, key), "is a setting of a local storage.root (a folder every node "
                             "mounts)" if s3 else f"is a setting of S3 storage; storage.root={storage.root!r} is "
                             "a local folder")
        debug = self.debug
        if debug.fail_stage is None:
            for key in ("fail_times", "fail_iteration"):
                if _differs_from_default(debug, key):
                    raise _cross(f"debug.{key}", getattr(debug, key), "qualifies debug.fail_stage, which is not set")
        kills = (debug.kill_flow_after, debug.kill_rank_mid_update, debug.stop_rank_mid_update)
        if (all(k is None for k in kills) and not debug.kill_during_checkpoint
                and _differs_from_default(debug, "kill_iteration")):
            raise _cross("debug.kill_iteration", debug.kill_iteration, "is the iteration of the debug.kill_* "
                         "faults, and none is set")

    def _check_unread_settings(self, spec: Any) -> None:
        """A setting that the chosen estimator, KL or loss never reads is refused (its value would change
        nothing)."""
        from engine.algos import ADV_ESTIMATORS

        algo, actor = self.algorithm, self.actor
        for key, arg in (("gamma", "gamma"), ("lam", "lam"), ("norm_adv_by_std", "norm_by_std")):
            if arg not in spec.reads and _differs_from_default(algo, key):
                readers = ", ".join(sorted(e.name for e in ADV_ESTIMATORS.values() if arg in e.reads))
                raise _cross(f"algorithm.{key}", getattr(algo, key), f"algorithm.adv_estimator={spec.name} does not "
                             f"read it (read by: {readers})")
        if not algo.use_kl_in_reward:
            for key in ("kl_penalty", "kl_ctrl", "kl_coef", "kl_target", "kl_horizon"):
                if _differs_from_default(algo, key):
                    raise _cross(f"algorithm.{key}", getattr(algo, key), "sets the KL penalty in the reward: it "
                                 "needs algorithm.use_kl_in_reward=true")
        elif algo.kl_ctrl == "fixed":
            for key in ("kl_target", "kl_horizon"):
                if _differs_from_default(algo, key):
                    raise _cross(f"algorithm.{key}", getattr(algo, key), "steers the adaptive KL controller: it "
                                 "needs algorithm.kl_ctrl=adaptive")
        if not actor.use_kl_loss:
            for key in ("kl_loss_coef", "kl_loss_type"):
                if _differs_from_default(actor, key):
                    raise _cross(f"actor.{key}", getattr(actor, key), "sets the KL loss: it needs "
                                 "actor.use_kl_loss=true")
        if actor.policy_loss == "gspo" and _differs_from_default(actor, "clip_ratio_c"):
            raise _cross("actor.clip_ratio_c", actor.clip_ratio_c, "is dual-clip PPO's bound (ppo_clip); "
                         "actor.policy_loss=gspo has no dual clip")

    def _check_safety(self) -> None:
        """A cost limit and a cost come together; the multiplier's settings need both."""
        algo = self.algorithm
        if algo.cost_limit is not None and self.reward.cost_function is None:
            raise _cross("algorithm.cost_limit", algo.cost_limit, "limits a cost, and there is none: set "
                         "reward.cost_function to a rule cost ('module:function')")
        if self.reward.cost_function is not None and algo.cost_limit is None:
            raise _cross("reward.cost_function", self.reward.cost_function, "is used only against a limit: set "
                         "algorithm.cost_limit")
        if algo.cost_limit is None:
            for key in ("lagrange_init", "lagrange_lr", "lagrange_max"):
                if _differs_from_default(algo, key):
                    raise _cross(f"algorithm.{key}", getattr(algo, key), "sets the Lagrange multiplier of safe RL: "
                                 "it needs algorithm.cost_limit and reward.cost_function")
        elif algo.lagrange_init > algo.lagrange_max:
            raise _cross("algorithm.lagrange_init", algo.lagrange_init, f"must be at most algorithm.lagrange_max "
                         f"({algo.lagrange_max})")

    def _check_partial(self, baseline: bool) -> None:
        partial = self.rollout.partial_tokens
        if partial is None:
            return
        if not self.trainer.max_staleness:
            raise _cross("rollout.partial_tokens", partial, "continues responses with newer weights while they are "
                         "generated: it needs the asynchronous schedule (trainer.max_staleness >= 1)")
        if partial >= self.rollout.max_new_tokens:
            raise _cross("rollout.partial_tokens", partial, f"must be below rollout.max_new_tokens "
                         f"({self.rollout.max_new_tokens}): no response would continue")
        for on, what in ((self.rollout.multi_turn.enable, "rollout.multi_turn.enable=true"),
                         (self.algorithm.filter_groups, "algorithm.filter_groups=true"),
                         (baseline, f"algorithm.adv_estimator={self.algorithm.adv_estimator}")):
            if on:
                raise _cross("rollout.partial_tokens", partial, f"is not built with {what} (partial rollouts are "
                             "single-turn, one prompt batch an iteration, without a greedy baseline)")

    def _check_multi_turn(self) -> None:
        mt, rollout = self.rollout.multi_turn, self.rollout
        if rollout.env is not None and rollout.agent is not None:
            raise _cross("rollout.agent", rollout.agent, "drives episodes, and so does rollout.env: give one")
        side, noun = ("rollout.env", "environment") if rollout.env is not None else ("rollout.agent", "agent")
        ref = rollout.episodes
        if not mt.enable:
            if ref is not None:
                raise _cross(side, ref, "runs multi-turn episodes: it needs rollout.multi_turn.enable=true")
            for key in ("tools", "format", "max_turns", "tool_timeout_s", "tool_memory_mb", "max_tool_response_chars",
                        *ENV_KEYS):
                if _differs_from_default(mt, key):
                    raise _cross(f"rollout.multi_turn.{key}", getattr(mt, key), "is a setting of multi-turn "
                                 "rollouts: it needs rollout.multi_turn.enable=true")
            return
        if ref is None:
            if not mt.tools:
                raise _cross("rollout.multi_turn.enable", True, "needs at least one tool (rollout.multi_turn.tools), "
                             "an environment (rollout.env) or an agent (rollout.agent), each 'module:name' or "
                             "'path/to/file.py:name'")
            for key in ENV_KEYS:
                if _differs_from_default(mt, key):
                    raise _cross(f"rollout.multi_turn.{key}", getattr(mt, key), "is a setting of an environment's "
                                 "or an agent's episodes: it needs rollout.env or rollout.agent")
            return
        for key in ("tools", "format", "tool_timeout_s", "tool_memory_mb", "max_tool_response_chars"):
            if _differs_from_default(mt, key):
                raise _cross(f"rollout.multi_turn.{key}", getattr(mt, key), f"is a setting of tool calls; with "
                             f"{side} the {noun} answers each turn (give it the tools)")
        if self.reward.function is not None:
            raise _cross("reward.function", self.reward.function, f"scores responses, and with {side} the "
                         f"{noun} gives the reward")
        if _differs_from_default(self.reward, "format_weight"):
            raise _cross("reward.format_weight", self.reward.format_weight, f"weighs a registered reward's format "
                         f"component, and with {side} the {noun} gives the reward")
        if self.reward.model.path is not None:
            raise _cross("reward.model.path", self.reward.model.path, f"reads the data's prompt, and with {side} "
                         f"an episode's prompt is the {noun}'s: a reward model beside it is not built")

    def _check_reward_model(self) -> None:
        model = self.reward.model
        if not model.enabled:
            for key in ("tokenizer_path", "dtype", "trust_remote_code", "weight", "micro_batch_size", "max_length",
                        "placement", "ranks"):
                if _differs_from_default(model, key):
                    raise _cross(f"reward.model.{key}", getattr(model, key), "is a setting of the reward model: it "
                                 "needs reward.model.path")
            if _differs_from_default(self.reward, "rule_weight"):
                raise _cross("reward.rule_weight", self.reward.rule_weight, "weighs the rule against a reward "
                             "model: it needs reward.model.path")
            return
        if model.placement == "colocated" and _differs_from_default(model, "ranks"):
            raise _cross("reward.model.ranks", model.ranks, "sizes the reward model's own pool: it needs "
                         "reward.model.placement=pool (colocated runs it on the policy's ranks)")
        if self.algorithm.filter_groups:
            raise _cross("algorithm.filter_groups", True, "judges groups by the rule score in the rollout stage; "
                         "with a reward model that is not built: leave one of them out")

    @property
    def safe_rl(self) -> bool:
        return self.algorithm.cost_limit is not None

    def _check_dynamic_sampling(self, estimator: str) -> None:
        """What dynamic sampling is built for: groups of a rule-scored, on-policy, group-based run."""
        if self.rollout.n < 2:
            raise _cross("algorithm.filter_groups", True, "drops groups whose responses all score the same: it needs "
                         "rollout.n >= 2 (a group of one always would be)")
        if self.trainer.max_staleness:
            raise _cross("algorithm.filter_groups", True, "is built for on-policy runs: the rollout of iteration i "
                         "starts from the sampler step where i-1's ended, so it needs trainer.max_staleness=0")
        from engine.algos import get_adv_estimator

        if get_adv_estimator(estimator).needs_baseline:
            raise _cross("algorithm.filter_groups", True, f"cannot be combined with algorithm.adv_estimator="
                         f"{estimator}: its baseline stage draws the iteration's prompts again")

    def stage_timeout(self, stage: str | None = None) -> tuple[float, str]:
        """(seconds, the setting they come from) for an engine call of `stage` (None: outside a stage)."""
        trainer = self.trainer
        if stage is not None and stage in trainer.stage_timeouts:
            return trainer.stage_timeouts[stage], f"trainer.stage_timeouts.{stage}"
        if trainer.stage_timeout_s is not None:
            return trainer.stage_timeout_s, "trainer.stage_timeout_s"
        tokens = self.data.train_batch_size * self.rollout.n * (self.data.max_prompt_length + self.rollout.max_new_tokens)
        return max(1800.0, 0.001 * tokens), "trainer.stage_timeout_s (default, scaled with the batch)"

    @property
    def max_model_len(self) -> int:
        """rollout.name=vllm: the longest prompt plus response an engine serves."""
        explicit = self.rollout.vllm.max_model_len
        return explicit if explicit is not None else self.data.max_prompt_length + self.rollout.max_new_tokens

    @property
    def needs_ref(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward or self.algorithm.objective == "dpo"

    @property
    def rollout_correction_mode(self) -> Literal["none", "truncate", "mask"]:
        """actor.rollout_correction.mode with auto resolved: truncate for an asynchronous run, else none."""
        mode = self.actor.rollout_correction.mode
        if mode == "auto":
            return "truncate" if self.trainer.max_staleness > 0 else "none"
        return mode

    def _check_vllm(self) -> None:
        """rollout.vllm sizes the vllm engine; rollout.weights chooses the hf loop's source."""
        rollout = self.rollout
        if rollout.name != "vllm":
            for key in type(rollout.vllm).model_fields:
                if _differs_from_default(rollout.vllm, key):
                    raise _cross(f"rollout.vllm.{key}", getattr(rollout.vllm, key),
                                 f"sizes the vllm engine; rollout.name={rollout.name}")
            return
        if rollout.weights == "copy":
            raise _cross("rollout.weights", "copy", "chooses the hf loop's source; the vllm engine holds its own "
                         "copy of the weights")
        if rollout.temperature > 2:
            raise _cross("rollout.temperature", rollout.temperature, "vLLM samples with a temperature up to 2")
        if rollout.vllm.memory_share is not None and rollout.vllm.kv_cache_gib is not None:
            raise _cross("rollout.vllm.memory_share", rollout.vllm.memory_share, "set memory_share or "
                         "kv_cache_gib, not both (an explicit KV cache ignores the share)")

    def _check_rollout_correction(self) -> None:
        """A setting of the correction that changes nothing in this config is refused."""
        corr = self.actor.rollout_correction
        mode = self.rollout_correction_mode
        for key in ("level", "upper", "lower"):
            if mode == "none" and _differs_from_default(corr, key):
                raise _cross(f"actor.rollout_correction.{key}", getattr(corr, key), "has no effect without a "
                             "correction: set actor.rollout_correction.mode=truncate or mask (auto is none for "
                             "an on-policy run)")
        if mode == "truncate" and _differs_from_default(corr, "lower"):
            raise _cross("actor.rollout_correction.lower", corr.lower, "is the lower bound of mode=mask; "
                         "truncate caps from above only")

    @property
    def needs_old_logp(self) -> bool:
        """Whether an old log-prob pass runs (see ActorConfig.reuses_update_logp)."""
        completions = self.data.train_batch_size * self.rollout.n
        return not self.actor.reuses_update_logp(completions, self.algorithm.use_kl_in_reward)

    def public_dict(self) -> dict[str, Any]:
        """JSON-able, credentials left out: what run.json, logs and Prefect parameters may hold."""
        data = self.model_dump(mode="json")
        data["storage"].pop("access_key_id", None)
        data["storage"].pop("secret_access_key", None)
        return data

    def config_hash(self) -> str:
        """sha256 of what decides the numbers (canonical JSON): the engine's attach check and the stage
        cache keys use it. Where results go, how often to save or validate, loggers, timeouts and
        faults are left out, so changing them on a resume keeps the live engine and cached stages."""
        data = self.public_dict()
        for section in ("storage", "ray", "debug"):
            data.pop(section, None)
        data["trainer"] = {k: data["trainer"][k] for k in _SEMANTIC_TRAINER_KEYS}
        blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


_SEMANTIC_TRAINER_KEYS = ("total_iterations", "world_size", "device", "seed", "max_staleness")


# The actor's settings that SFT's loss never reads (it keeps the optimizer, batching, sharding and LoRA).
SFT_INERT_ACTOR = ("policy_loss", "clip_low", "clip_high", "clip_ratio_c", "loss_agg_mode", "use_kl_loss",
                   "kl_loss_coef", "kl_loss_type", "entropy_coeff", "rollout_correction", "old_log_prob", "ppo_epochs")


def _changed(section: BaseModel, prefix: str) -> Iterator[tuple[str, Any]]:
    """Every setting of `section`, nested sections included, whose value is not its default, dotted."""
    for key, field in type(section).model_fields.items():
        value = getattr(section, key)
        if isinstance(value, BaseModel) and isinstance(field.get_default(call_default_factory=True), BaseModel):
            yield from _changed(value, f"{prefix}.{key}")
        elif _differs_from_default(section, key):
            yield f"{prefix}.{key}", value


def _changed_any(section: BaseModel) -> bool:
    return next(iter(_changed(section, "")), None) is not None


def _differs_from_default(section: BaseModel, key: str) -> bool:
    return bool(getattr(section, key) != type(section).model_fields[key].get_default(call_default_factory=True))


class _CrossSectionError(ValueError):
    def __init__(self, key: str, value: Any, allowed: str) -> None:
        super().__init__(allowed)
        self.key, self.value, self.allowed = key, value, allowed


ENV_KEYS = ("env_step_timeout_s", "env_memory_mb", "env_error_reward", "env_rollout_timeout_s")  # rollout.multi_turn's for rollout.env


def _cross(key: str, value: Any, allowed: str) -> _CrossSectionError:
    return _CrossSectionError(key, value, allowed)


MAX_TEXT = 4096  # characters of a string setting (PATH_MAX)


def text_problem(text: str) -> str | None:
    """Why `text` cannot be a string setting, or None: too long, a character that is not printable (a
    control character, or a format character such as U+202E RIGHT-TO-LEFT OVERRIDE that makes text read as
    something else), or a URL with credentials in it."""
    if len(text) > MAX_TEXT:
        return f"is {len(text)} characters long; at most {MAX_TEXT}"
    for char in text:
        if unicodedata.category(char) in ("Cc", "Cf", "Cs", "Zl", "Zp"):
            name = unicodedata.name(char, "a control character")
            return (f"holds U+{ord(char):04X} ({name}): a setting is printable text, without control or "
                    "bidirectional-format characters")
    if URL_USERINFO.search(text):
        return ("holds credentials in a URL (user:password@): a config is printed, logged and stored with the "
                "run; give S3 credentials as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment "
                "or an AWS credentials file")
    return None



def _strings(model: type[BaseModel], data: Any, prefix: str) -> Iterator[tuple[str, Any, str]]:
    """(dotted key, the setting's value, a string in it) for every string in `data`, the input of `model` (a
    mapping, or a model built already), nested sections included; a key that is no field is left to the
    check of keys, and a secret (SecretStr) is never shown."""
    if isinstance(data, BaseModel):
        data = {name: getattr(data, name) for name in type(data).model_fields}
    if not isinstance(data, dict):
        return
    for name, value in data.items():
        info = model.model_fields.get(name) if isinstance(name, str) else None
        if info is None or _is_secret_annotation(info.annotation) or _unwrap_optional(info.annotation) in (
                int, float, bool):  # a number given as text: parsed and ranged by the field
            continue
        key, sub = f"{prefix}{name}", info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            yield from _strings(sub, value, f"{key}.")
        else:
            yield from ((key, value, text) for text in _texts(value))


def _texts(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _texts(k)
            yield from _texts(v)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item)


def _shown(value: Any) -> str:
    """repr(value) for an error line: bounded in length and depth, URL credentials masked, and an integer
    too long for repr (over 4,300 digits) described instead."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # int's repr refuses past sys.get_int_max_str_digits()
        text = f"<an integer of {value.bit_length()} bits>"
    return mask_url_credentials(text)


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong, _REPR.maxlevel = 120, 120, 40, 4
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 10


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RLConfig:
    """Read a YAML config (default: configs/tiny_grpo.yaml), apply `key=value` overrides, validate."""
    source = Path(path) if path is not None else DEFAULT_CONFIG
    raw = _read_yaml(source)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    return build_config(raw)


def build_config(raw: dict[str, Any]) -> RLConfig:
    """Validate a nested dict into an RLConfig, turning any failure into one ConfigError line."""
    _check_keys(raw)
    try:
        return RLConfig.model_validate(raw)
    except ValidationError as err:
        raise _config_error(err, raw) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = _yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: byte 0x{err.object[err.start]:02x} "
                          f"at position {err.start}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(err).split())}") from None
    except _TooBig as err:
        raise ConfigError(f"config file {str(path)!r} {err} (a config is sections of settings)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


MAX_DEPTH = 16  # levels of nesting of a config: sections, a sub-section, a value and its items take 5
MAX_VALUES = 100_000  # lists, mappings and values of a config, its YAML aliases expanded


class _TooBig(ValueError):
    """A YAML text nests more than MAX_DEPTH levels deep, or holds more than MAX_VALUES values."""


class _Loader(yaml.SafeLoader):
    """yaml's safe loader, except that an integer too long for Python to read (over 4,300 digits) stays
    text: the setting it is given to then refuses it, by name."""


def _int_or_text(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    try:
        return yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError:
        return loader.construct_scalar(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _int_or_text)


def _yaml(text: str) -> Any:
    """The value of a YAML text as a tree (no list or mapping in two places, none inside itself); _TooBig
    past MAX_DEPTH levels or MAX_VALUES values. Brackets are counted on the text first: PyYAML's scanner
    slows quadratically with their depth (100,000 levels: minutes). It builds the value recursively, so deep
    indentation exhausts Python's stack (a RecursionError); and an alias (*name) shares a list: aliases of
    aliases hold 10**16 values in a few lines, and an alias inside its anchor is a cycle."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(text):  # quoted ones too: no setting holds 16 unclosed brackets
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        raise _TooBig(f"nests more than {MAX_DEPTH} levels deep")
    try:
        value = yaml.load(text, Loader=_Loader)  # noqa: S506 (the safe loader's constructors, one changed)
    except RecursionError:
        raise _TooBig(f"nests more than {MAX_DEPTH} levels deep") from None
    return _tree(value, 0, [MAX_VALUES])


_BRACKETS = re.compile(r"[\[\]{}]")


def _tree(node: Any, level: int, budget: list[int]) -> Any:
    """A copy of `node` whose lists and mappings are all new (an alias expanded), within the limits."""
    if level > MAX_DEPTH:
        raise _TooBig(f"nests more than {MAX_DEPTH} levels deep")
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooBig(f"holds more than {MAX_VALUES} values (its aliases expanded)")
    if isinstance(node, dict):
        return {key: _tree(value, level + 1, budget) for key, value in node.items()}
    if isinstance(node, list):
        return [_tree(item, level + 1, budget) for item in node]
    return node


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {_shown(item)} is not key=value (for example actor.lr=1e-5)")
    key, text = item.split("=", 1)
    key = key.strip()
    try:
        value = _yaml(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    except _TooBig as err:
        shown = key if key.isprintable() and len(key) <= 100 else _shown(key)
        raise ConfigError(f"{shown}=<{len(text)} characters> is not allowed: the value {err}") from None
    # YAML 1.1 reads "1e-5" as a string; pydantic then parses it as the field's type, so keep the text.
    if isinstance(value, str):
        value = text
    return key, value


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override key {key!r} must be section.field (for example actor.lr, actor.lora.rank); "
                          "sections: " + ", ".join(RLConfig.model_fields))
    _known_key(parts[0], parts[1:])
    node = raw
    for depth, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config section {'.'.join(parts[:depth + 1])!r} must be a mapping, got "
                              f"{_shown(node)}")
    node[parts[-1]] = value


def _check_keys(raw: dict[str, Any]) -> None:
    for section, body in raw.items():
        if section not in RLConfig.model_fields:
            _known_key(section, None)
        if isinstance(body, dict):
            _check_nested(section, [], body)


def _check_nested(section: str, path: list[str], body: dict[str, Any]) -> None:
    for field, value in body.items():
        model = _known_key(section, [*path, field])
        if isinstance(value, dict) and model is not None:
            _check_nested(section, [*path, field], value)


def _known_key(section: str, fields: list[str] | None) -> type[BaseModel] | None:
    """Check `section.f1.f2...` names config fields; returns the model of the last one when it is a
    sub-section (actor.lora), else None."""
    sections = RLConfig.model_fields
    for part in (section, *(fields or [])):
        if not (isinstance(part, str) and part.isprintable() and len(part) <= 100):  # echoed below as is
            raise ConfigError(f"config key {_shown(part)} is not a known key; sections: {', '.join(sections)}")
    if section not in sections:
        raise ConfigError(f"{section} is not a config section; allowed: {', '.join(sections)}")
    model: Any = sections[section].annotation
    where = section
    for field in fields or []:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigError(f"{where} is a value, not a section: {where}.{field} is not a known key")
        if field not in model.model_fields:
            raise ConfigError(f"{where}.{field} is not a known key; {where} has: {', '.join(model.model_fields)}")
        model, where = model.model_fields[field].annotation, f"{where}.{field}"
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _config_error(err: ValidationError, raw: dict[str, Any]) -> ConfigError:
    first = err.errors()[0]
    ctx = first.get("ctx") or {}
    cross = ctx.get("error")
    if isinstance(cross, _CrossSectionError):
        shown = "<hidden>" if _is_secret(cross.key.split(".")) else _shown(cross.value)
        return ConfigError(f"{cross.key}={shown} is not allowed: {cross.allowed}")
    loc = _field_path(first["loc"])
    key = ".".join(loc) if loc else "config"
    shown = "<hidden>" if _is_secret(loc) else _shown(_lookup(raw, loc))  # a secret is never echoed, whatever its type
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] in _RANGE_ERRORS and loc:
        message = _range_message(first["loc"], len(loc)) or message
    elif first["type"] in _NUMBER_ERRORS and loc:
        allowed = _range_message(first["loc"], len(loc))
        message = f"{message}; it {allowed}" if allowed else message
    return ConfigError(f"{key}={shown} is not allowed: {message}")


# pydantic's errors of a number outside its field's range: the line says the range, both ends
_RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number",
                 "int_parsing_size")
_NUMBER_ERRORS = ("int_parsing", "int_from_float", "int_type", "float_parsing", "float_type")  # + the range


def _range_message(loc: tuple[Any, ...], depth: int) -> str | None:
    """'must be in (0, 1]' for the field at loc[:depth], or 'each must be in [0, 86400]' when the error is
    about an item of it (loc goes on: a list index, a mapping key)."""
    model: Any = RLConfig
    info: Any = None
    for part in loc[:depth]:
        info = model.model_fields[part]
        model = info.annotation
    if info is None:
        return None
    if len(loc) > depth:
        annotation, metadata = _item_constraints(info.annotation)
        text = allowed_range(metadata, annotation)
        return f"each must be {text}" if text else None
    text = allowed_range(info.metadata, _unwrap_optional(info.annotation))
    return f"must be {text}" if text else None


def allowed_range(metadata: list[Any], annotation: Any) -> str | None:
    """A number's range from its constraints, both ends: 'in (0, 1]', 'an integer in [1, 4096]'; None
    when it has no lower or no upper end."""
    ends = interval(metadata)
    if ends is None:
        return None
    return f"{'an integer in' if annotation is int else 'in'} {ends}"


def interval(metadata: list[Any]) -> str | None:
    """'(0, 1]' from a number's constraints (annotated_types' Gt, Ge, Lt, Le); None without both ends."""
    bounds = {name: getattr(m, name) for m in metadata for name in ("gt", "ge", "lt", "le")
              if getattr(m, name, None) is not None}
    low = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds["gt"]) if "gt" in bounds else None
    high = (bounds["le"], "]") if "le" in bounds else (bounds["lt"], ")") if "lt" in bounds else None
    if low is None or high is None:
        return None
    return f"{low[0]}{_number(low[1])}, {_number(high[0])}{high[1]}"


def field_range(info: Any) -> str:
    """What a field allows, for the reference: a number's interval; a list's or a mapping's length and its
    items' interval."""
    union = [extra for member in get_args(info.annotation) if get_origin(member) is Annotated
             for extra in get_args(member)[1:]]  # `Annotated[list[str], Field(max_length=...)] | Literal[...]`
    constraints = [*info.metadata, *(m for extra in union for m in getattr(extra, "metadata", [extra]))]
    lengths = [m.max_length for m in constraints if getattr(m, "max_length", None) is not None]
    items = interval(_item_constraints(info.annotation)[1])
    parts = [interval(info.metadata), lengths and f"at most {lengths[0]} items", items and f"each in {items}"]
    return ", ".join(p for p in parts if p)


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _unwrap_optional(annotation: Any) -> Any:
    """`float | None` -> float; anything else as it is."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 and type(None) in get_args(annotation) else annotation


def _item_constraints(annotation: Any) -> tuple[Any, list[Any]]:
    """(type, constraints) of the items of a list, tuple or mapping setting (its values for a mapping)."""
    args = get_args(_unwrap_optional(annotation)) if get_origin(annotation) is not Literal else ()
    item = args[-1] if args else None
    if get_origin(item) is Annotated:
        base, *extra = get_args(item)
        return base, [m for e in extra for m in (getattr(e, "metadata", None) or [e])]
    return item, []


def _is_secret(loc: list[str]) -> bool:
    """Whether the field at `loc` holds a secret (a SecretStr)."""
    model: Any = RLConfig
    annotation: Any = None
    for part in loc:
        fields = getattr(model, "model_fields", {}) if isinstance(model, type) else {}
        if part not in fields:
            return False
        annotation = model = fields[part].annotation
    return _is_secret_annotation(annotation)


def _is_secret_annotation(annotation: Any) -> bool:
    return "SecretStr" in str(annotation)


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """The config key of a validation error's location: its field names (actor.lora.target_modules),
    without a list index or the union member pydantic appends (`list[str]`, `literal['all-linear']`)."""
    path: list[str] = []
    model: Any = RLConfig
    for part in loc:
        fields = getattr(model, "model_fields", {}) if isinstance(model, type) else {}
        if not isinstance(part, str) or part not in fields:
            break
        path.append(part)
        model = fields[part].annotation
    return path


def _lookup(raw: dict[str, Any], loc: list[str]) -> Any:
    node: Any = raw
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
