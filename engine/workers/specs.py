"""What the engine's ranks are built from: JSON-able specs that cross into the actor processes.

Their own module, importing only configs: a stage worker that attaches to a running engine
(tasks/context.py through engine.engine) needs the specs, not the workers' torch.distributed
checkpointing, FSDP and generation code (a stage worker's imports and tokenizer load: 5.8 CPU s, 6.8
with them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from engine.config import ActorConfig, CriticConfig, RefConfig, RolloutConfig
from engine.rewards.reward_model import RewardModelSpec


class PolicySpec(BaseModel):
    """What a policy rank is built from (JSON-able: it crosses into the actor process)."""

    model_path: str
    tokenizer_path: str
    dtype: str = "float32"
    trust_remote_code: bool = False
    rollout: RolloutConfig = RolloutConfig()
    actor: ActorConfig = ActorConfig()
    ref: RefConfig = RefConfig()
    use_ref: bool = False
    total_iterations: int = 1
    seed: int = 0
    reward_model: RewardModelSpec | None = None  # reward.model.placement=colocated: loaded in every policy rank
    sandbox_isolation: Literal["bwrap", "none"] = "bwrap"  # reward.sandbox.isolation: how tool calls are confined
    max_model_len: int = 2048  # rollout.name=vllm: the engine's longest prompt + response (RLConfig.max_model_len)
    max_prompt_length: int = 1024  # data.max_prompt_length: rollout.env pads an episode's prompt to it
    objective: Literal["rl", "sft", "dpo", "distill"] = "rl"  # algorithm.objective: the update's loss
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"  # algorithm.dpo_loss
    dpo_beta: float = 0.1  # algorithm.dpo_beta
    ipo_logratio: Literal["sum", "mean"] = "sum"  # algorithm.ipo_logratio
    teacher_path: str | None = None  # teacher.path: on-policy distillation's frozen teacher, in every rank
    teacher_micro_batch_size: int = 32  # teacher.micro_batch_size


class CriticSpec(BaseModel):
    model_path: str
    dtype: str = "float32"
    trust_remote_code: bool = False
    critic: CriticConfig = CriticConfig()
    max_response_length: int = Field(16, gt=0, description="rollout.max_new_tokens: Dr. GRPO's normalizer")
    total_iterations: int = 1
    seed: int = 0
