"""The host memory the engine's ranks would take, estimated from the models' config.json before any rank
starts, and a refusal when it exceeds this machine's (MemTotal, or the cgroup's limit when lower).

What it counts, per rank (P parameters, W = trainer.world_size, m = bytes of a sharded parameter: 4 with
actor.mixed_precision=bf16, whose master weights are fp32 (engine.workers.fsdp), else model.dtype's):
  actor       P x m / W for the shards, the same again for their gradients and twice for AdamW's two
              moments (LoRA: the frozen shards only; the adapters' share is left out, it is small)
  generation  one full model in the compute dtype (bf16 under mixed precision, else model.dtype): the
              actor gathered for the rollout (rollout.weights=actor), the copy (weights=copy), or the vLLM
              engine's weights (rollout.name=vllm) plus its reserve (rollout.vllm.kv_cache_gib, or
              memory_share x this machine's memory)
  ref, teacher  P x m / W each when present (frozen shards)
  logits      2 x rows x tokens x vocabulary x 4 bytes for the update's micro-batch (the float logits and
              their gradient; tokens: the response's, or prompt and response with actor.packed_sequences or
              the padded layout), rows x tokens capped by actor.max_tokens_per_micro_batch
  process     RANK_PROCESS_BYTES: torch, transformers and Ray loaded in a rank
and the critic's ranks (PPO) as the actor's, without generation; a split rollout pool's ranks hold the
generation term and a process each. Activations other than the logits, the reward model and the
stages' own processes are not counted: it is a floor, not a bound, and a run it admits can still run out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError
from engine.workers.specs import CriticSpec, PolicySpec

log = logging.getLogger("rlflow.engine")

GiB = 2**30
# A rank's process with torch, transformers, Ray and the worker imported: 489 MiB RSS measured here
# (Python 3.11, torch 2.13 CPU, transformers 5.19), rounded up.
RANK_PROCESS_BYTES = GiB // 2
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    parameters: int  # tied weights counted once
    vocab_size: int


@dataclass(frozen=True)
class MemoryEstimate:
    total: int  # bytes, every rank of the engine
    per_rank: dict[str, int]  # a policy rank's terms (actor, generation, ref, teacher, logits, process)
    ranks: int  # processes counted

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in self.per_rank.items() if v)
        return f"{self.total / GiB:.1f} GiB for {self.ranks} ranks (a policy rank: {parts} GiB)"


def model_shape(path: str, trust_remote_code: bool = False) -> ModelShape:
    """Parameters and vocabulary of the causal LM at `path`, from its config alone: the model is built
    on the meta device (names and shapes, no memory), so any family transformers builds is counted."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.loading import ModelLoadError, first_line

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot size the model {path!r} from its config: {first_line(err)}") from err
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return ModelShape(parameters=int(model.num_parameters()), vocab_size=vocab)


def estimate_memory(policy: PolicySpec, critic: CriticSpec | None, *, world_size: int, rollout_ranks: int,
                    host_bytes: int) -> MemoryEstimate:
    """The engine's host memory by the terms in the module's docstring; `host_bytes` sizes a vLLM
    memory_share."""
    actor = policy.actor
    shape = model_shape(policy.model_path, policy.trust_remote_code)
    shard = 4 if actor.mixed_precision == "bf16" else _BYTES[policy.dtype]
    compute = 2 if actor.mixed_precision == "bf16" else _BYTES[policy.dtype]
    states = 1 if actor.lora.rank > 0 else 4  # shards (+ gradients and two AdamW moments when they train)
    sharded = shape.parameters * shard // world_size
    generation = shape.parameters * compute
    if policy.rollout.name == "vllm":
        sizing = policy.rollout.vllm.sizing()
        generation += int(sizing.get("kv_cache_memory_bytes") or sizing["gpu_memory_utilization"] * host_bytes)
    # The default layout ("shared") runs each prompt once and keeps logits for the responses only; the
    # padded and packed ones take logits at every position (policy.response_logits).
    row = policy.max_model_len - (policy.max_prompt_length if actor.forward_layout == "shared" else 0)
    tokens = max(row, 1) * actor.micro_batch_size
    if actor.max_tokens_per_micro_batch is not None:
        tokens = min(tokens, actor.max_tokens_per_micro_batch)
    per_rank = {
        "actor": sharded * states,
        "generation": 0 if rollout_ranks else generation,
        "ref": sharded if policy.use_ref and actor.lora.rank == 0 else 0,
        "teacher": (model_shape(policy.teacher_path, policy.trust_remote_code).parameters * shard // world_size
                    if policy.teacher_path else 0),
        "logits": 2 * tokens * shape.vocab_size * 4,
        "process": RANK_PROCESS_BYTES,
    }
    total = sum(per_rank.values()) * world_size + rollout_ranks * (generation + RANK_PROCESS_BYTES)
    ranks = world_size + rollout_ranks
    if critic is not None:
        params = shape.parameters if critic.model_path == policy.model_path else \
            model_shape(critic.model_path, critic.trust_remote_code).parameters
        critic_shard = 4 if critic.critic.mixed_precision == "bf16" else _BYTES[critic.dtype]
        critic_states = 1 if critic.critic.lora.rank > 0 else 4
        total += world_size * (params * critic_shard // world_size * critic_states + RANK_PROCESS_BYTES)
        ranks += world_size
    return MemoryEstimate(total=total, per_rank=per_rank, ranks=ranks)


def host_memory() -> int:
    """This machine's memory: MemTotal, or the cgroup's limit (v2 memory.max, v1 limit_in_bytes) when lower."""
    import psutil

    total = int(psutil.virtual_memory().total)
    for limit in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def check_memory(policy: PolicySpec, critic: CriticSpec | None, *, world_size: int, rollout_ranks: int,
                 available: int | None = None) -> MemoryEstimate:
    """ConfigError (one line, with the figures and the settings that lower them) when the estimate exceeds
    `available` (default: host_memory())."""
    have = host_memory() if available is None else available
    estimate = estimate_memory(policy, critic, world_size=world_size, rollout_ranks=rollout_ranks, host_bytes=have)
    if estimate.total > have:
        raise ConfigError(
            f"the engine would need at least {estimate.describe()}; this machine has {have / GiB:.1f} GiB: "
            "lower actor.micro_batch_size or actor.max_tokens_per_micro_batch (logits), rollout.vllm.kv_cache_gib "
            "or memory_share (vLLM's reserve), train LoRA adapters (actor.lora.rank>0: no gradients or optimizer "
            "state for the base), use model.dtype=bfloat16 without actor.mixed_precision (half the bytes, no fp32 "
            "master copy), or choose a smaller model.path")
    log.debug("memory estimate: %s of %.1f GiB", estimate.describe(), have / GiB)
    return estimate
