"""PolicyWorker: actor, rollout and reference in one process per rank (the hybrid engine).

- actor: the policy under FSDP2 with AdamW, gradient clipping and an LR schedule; it is what trains.
- rollout: generation. `rollout.weights=actor` (default): from the actor itself, its parameters gathered
  for the rollout and resharded after, so no rank holds a second copy of the model; `copy`: an unsharded
  copy, refreshed from the actor's shards after every update (`timing_s/weight_sync`).
- ref: the frozen initial policy, sharded, for KL (only when a KL term is configured).

Batches carry: `input_ids` [B, P+T] and `attention_mask` [B, P+T] (left-padded prompt, right-padded
response), `responses` [B, T], `response_mask` [B, T]; the update also reads `old_logp`, `adv` [B, T]
and `ref_logp` [B, T] when the KL loss is on.
"""

from __future__ import annotations

import copy
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from engine import algos
from engine.batch import Batch
from engine.config import RolloutConfig
from engine.models import lora
from engine.models.loading import dropout_left, load_model, load_tokenizer
from engine.models.tokens import cache_argument, packed_inputs, positions, stop_token_ids
from engine.rewards.reward_model import prompts_of
from engine.rollout.agents import AgentEpisodes, Sampling
from engine.rollout.backends import make_rollout
from engine.rollout.base import SamplingParams
from engine.rollout.envs import EnvEpisodes, EnvLimits, check_chat_template, env_files
from engine.rollout.multi_turn import generate_multi_turn, run_episodes
from engine.rollout.tools import load_tools, observation_renderer
from engine.seeds import derive_seed
from engine.state import weight_sync
from engine.workers import fsdp
from engine.workers.base import RankWorker, traced
from engine.workers.reward_model_worker import RewardModelScorer
from engine.workers.specs import PolicySpec

SYNC_BUCKET_BYTES = 32 * 2**20  # rollout.name=vllm: the weights gathered per all-gather into the engine


def vllm_engine(spec: PolicySpec) -> dict[str, Any]:
    """engine.rollout.vllm.VLLMRollout's keywords for this spec: the actor's compute precision, a seed of
    the run's."""
    dtype = "bfloat16" if spec.actor.mixed_precision == "bf16" else spec.dtype
    return {"model_path": spec.model_path, "tokenizer_path": spec.tokenizer_path, "cfg": spec.rollout.vllm,
            "max_model_len": spec.max_model_len, "dtype": dtype, "seed": derive_seed(spec.seed, 0, "vllm-engine") % 2**32,
            "trust_remote_code": spec.trust_remote_code}


def policy_model(spec: PolicySpec) -> tuple[Any, nn.Module, list[int], Any]:
    """(tokenizer, model, stop token ids, LoRA's PeftModel or None): the policy as both pools load it, the
    torch seed set first; with actor.lora the adapters are on, named as on the actor."""
    torch.manual_seed(spec.seed)
    tokenizer = load_tokenizer(spec.tokenizer_path, trust_remote_code=spec.trust_remote_code)
    model = load_model(spec.model_path, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code)
    stops = sorted(stop_token_ids(tokenizer, model))
    peft: Any = None
    if spec.actor.lora.enabled:
        model, peft = lora.apply_lora(model, spec.actor.lora, task="CAUSAL_LM", what="actor.lora")
    return tokenizer, model, stops, peft


def rollout_tools(spec: PolicySpec, tokenizer: Any) -> dict[str, Any]:
    """rollout.multi_turn: the tools by name ({} when off, or with rollout.env); a format the chat template
    cannot render, or an environment's model without a chat template, is refused here."""
    if not spec.rollout.multi_turn.enable:
        return {}
    if spec.rollout.episodes is not None:
        check_chat_template(tokenizer)
        return {}
    tools = load_tools(spec.rollout.multi_turn.tools)
    observation_renderer(tokenizer, spec.rollout.multi_turn.format)
    return tools


class PolicyWorker(RankWorker):
    def __init__(self, *, spec: dict[str, Any], **identity: Any) -> None:
        super().__init__(**identity)
        self.spec = PolicySpec.model_validate(spec)
        self._is_weight_max = 0.0
        self.sync_group: weight_sync.SyncGroup | None = None  # placement.mode=split: rank 0 sends to the rollout pool

    def setup(self) -> None:
        """Load the three models; called on every rank after torch.distributed is up."""
        spec = self.spec
        # LoRA: self.peft is the PeftModel around the actor (it switches the adapters off for the ref).
        self.tokenizer, base, stops, self.peft = policy_model(spec)
        self.rollout_model: nn.Module | None = None  # the copy (rollout.weights=copy)
        self.vllm = spec.rollout.name == "vllm"  # a vLLM engine holds its own copy, refreshed after each update
        if spec.rollout.weights == "copy" and not self.vllm:
            self.rollout_model = copy.deepcopy(base)  # unsharded, generation only
            if spec.actor.mixed_precision == "bf16":  # generate with the precision the actor computes in
                self.rollout_model.to(torch.bfloat16)
        # Every model is loaded without dropout (engine.models.loading): train mode changes nothing but autograd.
        self.actor = fsdp.shard_model(base, **fsdp.shard_options(spec.actor))
        self.optimizer = fsdp.build_optimizer(self.actor, spec.actor)
        self.scheduler = fsdp.build_scheduler(self.optimizer, spec.actor, spec.total_iterations)
        self.ref: nn.Module | None = None
        if spec.use_ref and self.peft is None:  # the actor's precision and offload, no checkpointing (no backward)
            ref = load_model(spec.model_path, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code)
            ref.requires_grad_(False)
            self.ref = fsdp.shard_model(ref.eval(), mixed_precision=spec.actor.mixed_precision,
                                        cpu_offload=spec.actor.cpu_offload)
        self.teacher: nn.Module | None = None
        if spec.teacher_path is not None:  # distillation: frozen, sharded as the reference is
            teacher = load_model(spec.teacher_path, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code)
            teacher.requires_grad_(False)
            self.teacher = fsdp.shard_model(teacher.eval(), mixed_precision=spec.actor.mixed_precision,
                                            cpu_offload=spec.actor.cpu_offload)
        generator = self.rollout_model if self.rollout_model is not None else self.actor
        self.rollout = make_rollout(spec.rollout.name, generator, int(self.tokenizer.pad_token_id), stops,
                                    **(vllm_engine(spec) if self.vllm else {}))
        self.tools = rollout_tools(spec, self.tokenizer)
        self.reward_model: RewardModelScorer | None = None
        if spec.reward_model is not None:  # last, and on a forked RNG: the policy's draws do not depend on it
            with torch.random.fork_rng(devices=[]):
                self.reward_model = RewardModelScorer(spec.reward_model)

    @traced
    def score_rm(self, batch: Batch) -> Batch:
        """reward.model.placement=colocated: `rm_score` [B] of this rank's rows (`prompt_json`, `response_text`)."""
        if self.reward_model is None:
            raise RuntimeError("this policy was built without a colocated reward model")
        self.actor.eval()
        return Batch({"rm_score": self.reward_model.score(prompts_of(batch["prompt_json"]), batch["response_text"])}, {})

    # -- generation ---------------------------------------------------------------------------------
    @traced
    def generate(self, prompts: Batch, *, iteration: int, expected_version: int | None, do_sample: bool = True,
                 draw: int = 0, part: int = 0, max_new_tokens: int | None = None) -> Batch:
        """prompts: `input_ids`, `attention_mask` [B, P] left padded -> the batch with the response columns."""
        self.check_version(expected_version)
        with self._generating():
            return generate_batch(self.rollout, prompts, self.spec.rollout, seed=self.spec.seed, iteration=iteration,
                                  rank=self.rank, do_sample=do_sample, version=self.version, draw=draw,
                                  tokenizer=self.tokenizer, tools=self.tools,
                                  isolation=self.spec.sandbox_isolation, prompt_width=self.spec.max_prompt_length,
                                  part=part, max_new_tokens=max_new_tokens)

    @contextmanager
    def _generating(self) -> Iterator[None]:
        """From the actor: its parameters gathered for the whole rollout (one all-gather per layer, the same
        on every rank; no collective while decoding, so ranks may take different numbers of steps), then
        resharded. From the copy: nothing to do."""
        if self.rollout_model is not None or self.vllm:
            yield
            return
        self.actor.eval()
        with fsdp.gathered(self.actor, self.spec.actor.reshard_after_forward):
            yield

    # -- log-probs ---------------------------------------------------------------------------------
    @torch.no_grad()
    @traced
    def compute_log_prob(self, batch: Batch, *, expected_version: int | None) -> Batch:
        """Old log-probs and entropy of the responses under the actor: `old_logp`, `entropy` [B, T]."""
        self.check_version(expected_version)
        self.actor.eval()
        budget = self.spec.rollout.log_prob_max_tokens_per_micro_batch or self.spec.actor.max_tokens_per_micro_batch
        logp, entropy, chunks = self._forward_chunks(self.actor, batch, self.spec.actor.micro_batch_size, budget,
                                                     entropy=True)
        return Batch({"old_logp": logp, "entropy": entropy}, {}, {"micro_batches": chunks})

    @torch.no_grad()
    @traced
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """`ref_logp` [B, T] under the frozen reference policy: the reference model, or with LoRA the actor
        with its adapters off (the base model, in the same weights: no second copy)."""
        if not self.spec.use_ref:
            raise RuntimeError("this policy was built without a reference model (no KL term configured)")
        ref = self.spec.ref
        if self.peft is not None:
            self.actor.eval()
            with lora.adapters_disabled(self.peft):
                logp, _, chunks = self._forward_chunks(self.actor, batch, ref.micro_batch_size,
                                                       ref.max_tokens_per_micro_batch, entropy=False)
        else:
            assert self.ref is not None
            logp, _, chunks = self._forward_chunks(self.ref, batch, ref.micro_batch_size,
                                                   ref.max_tokens_per_micro_batch, entropy=False)
        return Batch({"ref_logp": logp}, {}, {"micro_batches": chunks})

    @torch.no_grad()
    @traced
    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """`teacher_logp` [B, T]: on-policy distillation's teacher's log-probs of the sampled tokens, at the
        rollout's temperature (the distribution the student sampled from is compared with the teacher's)."""
        if self.teacher is None:
            raise RuntimeError("this policy was built without a teacher (algorithm.objective is not distill)")
        logp, _, chunks = self._forward_chunks(self.teacher, batch, self.spec.teacher_micro_batch_size, None,
                                               entropy=False)
        return Batch({"teacher_logp": logp}, {}, {"micro_batches": chunks})

    @torch.no_grad()
    def rollout_log_prob(self, batch: Batch) -> Batch:
        """`logp` [B, T] of the generating weights (the copy, or the actor gathered as for a rollout):
        checks the train-to-generate path."""
        with self._generating():
            model = self.rollout_model if self.rollout_model is not None else self.actor
            logits = response_logits(model, batch, self.spec.rollout.temperature, "padded")
        return Batch({"logp": algos.logprobs_from_logits(logits, batch["responses"])}, {})

    def _forward_chunks(self, model: nn.Module, batch: Batch, rows: int, tokens: int | None, entropy: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """[B, T] log-probs (and entropies) of `batch`'s responses, in micro-batches planned as the update's
        (the same count on every rank: each forward all-gathers), and that count."""
        layout = self.spec.actor.forward_layout
        plan = fsdp.plan_micro_batches(batch, max_rows=rows, max_tokens=tokens, packed=layout == "packed",
                                       group_prompts=layout == "shared")
        logp = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        ent = torch.zeros_like(logp)
        for micro_rows in plan:
            micro = fsdp.micro_batch(batch, micro_rows)
            logits = response_logits(model, micro, self.spec.rollout.temperature, layout)  # [b, T, V]
            if not micro_rows:  # an empty micro-batch: run for the collectives, nothing to keep
                continue
            logp[micro_rows] = algos.logprobs_from_logits(logits, micro["responses"])
            if entropy:
                ent[micro_rows] = algos.entropy_from_logits(logits)
        return logp, ent, len(plan)

    # -- update ------------------------------------------------------------------------------------
    @traced
    def update_actor(self, batch: Batch, *, iteration: int, expected_version: int | None) -> dict[str, float]:
        """PPO epochs over mini-batches with gradient accumulation; the version becomes `iteration`."""
        self.check_version(expected_version)
        gen = torch.Generator().manual_seed(derive_seed(self.spec.seed, iteration, "update_actor", self.rank))
        self.rollout.sleep()  # woken by sync_rollout_weights, which the engine calls after every update
        self.actor.train()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this update's optimizer steps use
        self._is_weight_max = 0.0
        with self.applying_update():
            local = fsdp.train_epochs(batch, model=self.actor, optimizer=self.optimizer, cfg=self.spec.actor,
                                      loss_agg_mode=self.spec.actor.agg_mode, generator=gen,
                                      micro_loss=self._micro_loss, grad_norm_key="actor/grad_norm",
                                      after_backward=self._maybe_exit,
                                      group_prompts=self.spec.actor.forward_layout == "shared")
        self.scheduler.step()
        self.version = iteration
        local["actor/lr"] = torch.tensor(lr)
        metrics = fsdp.all_reduce_mean(local)
        if self._corrects:  # the largest weight before truncation, over every token of every rank
            metrics["rollout_corr/is_weight_max"] = fsdp.global_max(self._is_weight_max)
        return metrics

    @property
    def _corrects(self) -> bool:
        """Whether the update weighs tokens by pi_trainer / pi_rollout: actor.rollout_correction.mode, as the
        flow resolved it (auto is resolved there, from trainer.max_staleness; here it means none)."""
        return self.spec.actor.rollout_correction.mode in ("truncate", "mask")

    def gradients(self, batch: Batch, *, micro_batch_size: int | None = None, loss_agg_mode: str | None = None,
                  max_tokens_per_micro_batch: int | None = None, objective: str | None = None
                  ) -> dict[str, torch.Tensor]:
        """The gradient the update would step with on `batch` as ONE mini-batch (before clipping), full
        tensors on every rank; the weights and optimizer are untouched. For equivalence tests: the update's
        own code path (accumulate_gradients), with the micro-batching, aggregation and objective (rl, sft)
        overridable."""
        actor = self.spec.actor.model_copy(update={
            "micro_batch_size": micro_batch_size or self.spec.actor.micro_batch_size,
            "loss_agg_mode": loss_agg_mode or self.spec.actor.agg_mode,
            "max_tokens_per_micro_batch": max_tokens_per_micro_batch or self.spec.actor.max_tokens_per_micro_batch})
        saved, self.spec = self.spec, self.spec.model_copy(update={"actor": actor,
                                                                   "objective": objective or self.spec.objective})
        try:
            self.actor.train()
            self.optimizer.zero_grad(set_to_none=True)
            fsdp.accumulate_gradients(batch, model=self.actor, cfg=actor, loss_agg_mode=actor.agg_mode,
                                      micro_loss=self._micro_loss, group_prompts=actor.forward_layout == "shared")
            return fsdp.full_gradients(self.actor)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.spec = saved

    def _maybe_exit(self) -> None:
        if self.exit_mid_update:  # a test fault: SIGKILL this rank with half an update done
            os.kill(os.getpid(), signal.SIGKILL)
        if self.stop_mid_update:  # a test fault: this rank hangs (alive, stopped) with half an update done
            self.stop_mid_update = False
            os.kill(os.getpid(), signal.SIGSTOP)

    def _micro_loss(self, micro: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.spec.actor
        length = self.spec.rollout.max_new_tokens  # Dr. GRPO's constant normalizer (algos.agg)
        mask = micro["response_mask"]
        if self.spec.objective == "dpo":
            return self._pair_loss(micro)
        if self.spec.objective == "sft":  # the negative log-likelihood of the assistant's tokens (token-mean)
            logp = algos.logprobs_from_logits(response_logits(self.actor, micro, 1.0, cfg.forward_layout),
                                              micro["responses"])
            loss = algos.agg_loss(loss_mat=-logp, loss_mask=mask, loss_agg_mode=cfg.agg_mode, max_response_length=length)
            return loss, {"actor/sft_loss": loss.detach(), "actor/loss": loss.detach()}
        logits = response_logits(self.actor, micro, self.spec.rollout.temperature, cfg.forward_layout)  # [b, T, V]
        logp = algos.logprobs_from_logits(logits, micro["responses"])
        policy_loss = algos.get_policy_loss(cfg.policy_loss)
        # No old_logp column: the stages skipped that pass because this update is one optimizer step
        # from the weights before it (ActorConfig.reuses_update_logp): old = current, detached.
        old_logp = micro["old_logp"] if "old_logp" in micro else logp.detach()
        adv = micro["adv"]
        is_stats: dict[str, torch.Tensor] = {}
        if self._corrects:  # the rollout's policy is not the trainer's (stale, or another engine): correct
            if "rollout_logp" not in micro:
                raise RuntimeError("actor.rollout_correction needs the rollout's own log-probs (rollout_logp), and "
                                   "this batch has none")
            corr = cfg.rollout_correction
            weights, is_stats = algos.rollout_correction(
                old_logp=old_logp, rollout_logp=micro["rollout_logp"], response_mask=mask,
                mode=corr.mode, level=cfg.correction_level, upper=corr.upper, lower=corr.lower)  # type: ignore[arg-type]
            self._is_weight_max = max(self._is_weight_max, float(is_stats.pop("is_weight_max")))
            adv = adv * weights  # = weights x the clipped surrogate (engine.algos.correction)
        pg_loss, pg_stats = policy_loss(
            logp=logp, old_logp=old_logp, adv=adv,
            response_mask=mask,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=cfg.agg_mode, max_response_length=length,
        )
        with torch.set_grad_enabled(cfg.entropy_coeff > 0 and torch.is_grad_enabled()):  # else a statistic only
            entropy = algos.agg_loss(loss_mat=algos.entropy_from_logits(logits), loss_mask=mask,
                                     loss_agg_mode=cfg.agg_mode, max_response_length=length)
        loss = pg_loss - cfg.entropy_coeff * entropy if cfg.entropy_coeff > 0 else pg_loss
        stats = {"actor/pg_loss": pg_loss.detach(), "actor/entropy": entropy.detach(),
                 **{f"actor/{k}": v.detach() for k, v in pg_stats.items()},
                 **{f"rollout_corr/{k}": v.detach() for k, v in is_stats.items()}}
        if cfg.use_kl_loss:
            kl, _ = algos.kl_loss(logp=logp, ref_logp=micro["ref_logp"], response_mask=mask,
                                  estimator=cfg.kl_loss_type, loss_agg_mode=cfg.agg_mode,
                                  max_response_length=length)
            loss = loss + cfg.kl_loss_coef * kl
            stats["actor/kl_loss"] = kl.detach()
        stats["actor/loss"] = loss.detach()  # pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss
        return loss, stats

    def _pair_loss(self, micro: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """algorithm.objective=dpo: DPO's or IPO's loss (engine.algos.preference), the mean over the
        micro-batch's pairs; each row holds a pair (engine.data.preferences), and the update weighs
        micro-batches by their pairs (the flow sets actor.loss_agg_mode to seq-mean-token-sum)."""
        from engine.data.preferences import rejected_view

        layout = self.spec.actor.forward_layout
        rejected = rejected_view(micro)
        reduce = self.spec.ipo_logratio  # a response's log-likelihood: the sum over its tokens, or IPO's mean
        sums = [algos.sequence_logp(algos.logprobs_from_logits(response_logits(self.actor, side, 1.0, layout),
                                                               side["responses"]), side["response_mask"], reduce)
                for side in (micro, rejected)]
        losses, stats = algos.preference_loss(
            chosen_logp=sums[0], rejected_logp=sums[1],
            ref_chosen_logp=algos.sequence_logp(micro["ref_logp"], micro["response_mask"], reduce),
            ref_rejected_logp=algos.sequence_logp(micro["rejected_ref_logp"], rejected["response_mask"], reduce),
            beta=self.spec.dpo_beta, kind=self.spec.dpo_loss)
        real = (micro["response_mask"].sum(dim=-1) > 0).to(losses.dtype)  # an empty micro-batch's row counts 0
        pairs = real.sum().clamp(min=1)
        loss = (losses * real).sum() / pairs
        out = {f"actor/{k}": (v * real).sum() / pairs for k, v in stats.items()}
        out.update({"actor/dpo_loss": loss.detach(), "actor/loss": loss.detach()})
        return loss, out

    # -- weights -----------------------------------------------------------------------------------
    def sync_rollout_weights(self) -> dict[str, float]:
        """Gather the actor's shards into the rollout copy (every rank calls it: an all-gather). Generating
        from the actor itself there is nothing to sync. With LoRA only the adapters are gathered: the copy
        holds the same frozen base weights and generates with the adapters (unmerged, so the base stays
        exact whatever the number of updates)."""
        start = time.perf_counter()
        sent = 0
        if self.vllm:  # streamed from the shards, bucket by bucket, into the engine (LoRA: merged)
            self.rollout.wake()
            sent = self.rollout.load_weights(fsdp.stream_full(self.actor, SYNC_BUCKET_BYTES))
        elif self.rollout_model is not None:
            state = fsdp.full_state_dict(self.actor, trainable_only=self.peft is not None)
            sent = self.rollout.load_weights(state.items(), partial=self.peft is not None)
        return {"timing_s/weight_sync": time.perf_counter() - start, "perf/weight_sync_mb": sent / 2**20}

    def join_sync_group(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        """placement.mode=split: rank 0 joins the group spanning it and the rollout ranks, as their sender."""
        if self.rank == 0:
            store = self.rendezvous_store(host, port, timeout_s, master=True)
            self.sync_group = weight_sync.join_sync_group(store, 0, world_size, timeout_s)

    @traced
    def send_weights(self, bucket_mb: float) -> dict[str, float]:
        """The actor's full weights (LoRA: the adapters) to the rollout pool: every rank joins the gather,
        rank 0 broadcasts them in buckets over the sync group (the rollout ranks call `receive_weights`)."""
        start = time.perf_counter()
        if self.vllm:  # the pool's engines take whole weights (LoRA: merged), named as the transformers model's
            state = dict(fsdp.stream_full(self.actor, SYNC_BUCKET_BYTES))
        else:
            state = fsdp.full_state_dict(self.actor, trainable_only=self.peft is not None)
        for name in weight_sync.tied_duplicates(self.actor):
            state.pop(name, None)
        gathered = time.perf_counter() - start
        if self.rank != 0:
            return {}
        if self.sync_group is None:
            raise RuntimeError("send_weights: this engine has no rollout pool (placement.mode=colocated)")
        sent = weight_sync.send(self.sync_group, state, int(bucket_mb * 2**20))
        seconds = time.perf_counter() - start
        return {"timing_s/weight_sync": seconds, "perf/weight_sync_mb": sent / 2**20,
                "perf/weight_sync_mb_per_s": sent / 2**20 / seconds, "timing_s/weight_sync_gather": gathered}

    @traced
    def save(self, url: str, storage_options: dict[str, Any]) -> list[dict[str, Any]]:
        """Sharded state into `url` (with LoRA: the adapters and their optimizer state, not the frozen
        base); the files this rank wrote, with the sha256 taken while writing."""
        extra = {"scheduler": self.scheduler.state_dict(), "rng": fsdp.rng_state(), "version": self.version}
        return fsdp.save_sharded(url, self.actor, self.optimizer, extra, storage_options,
                                 trainable_only=self.peft is not None)

    @traced
    def load(self, url: str, storage_options: dict[str, Any], expected: dict[str, tuple[int, str]] | None = None
             ) -> int:
        """Restore actor, optimizer, scheduler and RNG from `url` (each file verified against `expected`
        as it is read); refresh the rollout copy; the version is the checkpoint's."""
        extra = fsdp.load_sharded(url, self.actor, self.optimizer, storage_options, expected,
                                  trainable_only=self.peft is not None)
        self.scheduler.load_state_dict(extra["scheduler"])
        fsdp.set_rng_state(extra["rng"])
        self.version = int(extra["version"])
        self.sync_rollout_weights()
        return self.version

    def export_hf(self, url: str, storage_options: dict[str, Any], merged_url: str | None = None) -> str | None:
        """Hugging Face weights + tokenizer at `url`, written by rank 0 (every rank joins the gather).
        With LoRA, `url` gets peft's adapter folder (only the adapters are gathered; it loads with
        `peft.PeftModel.from_pretrained(base, url)`), and `merged_url`, when given, the base model with
        the adapters merged in (plain transformers)."""
        import tempfile

        state = fsdp.full_state_dict_rank0(self.actor, trainable_only=self.peft is not None)
        if self.rank != 0:
            return None
        model = load_model(self.spec.model_path, dtype=self.spec.dtype, trust_remote_code=self.spec.trust_remote_code)
        with tempfile.TemporaryDirectory(prefix="rlflow-export-") as tmp:
            if self.peft is None:
                model.load_state_dict(state)
                model.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
                _upload(tmp, url, storage_options)
                return url
            wrapped = lora.save_adapter_folder(model, self.spec.actor.lora, state, f"{tmp}/adapter", task="CAUSAL_LM",
                                               base_path=self.spec.model_path)
            self.tokenizer.save_pretrained(f"{tmp}/adapter")
            _upload(f"{tmp}/adapter", url, storage_options)
            if merged_url is not None:
                merged = wrapped.merge_and_unload()
                merged.save_pretrained(f"{tmp}/merged")
                self.tokenizer.save_pretrained(f"{tmp}/merged")
                _upload(f"{tmp}/merged", merged_url, storage_options)
        return url

    def state_dtypes(self) -> dict[str, list[str]]:
        """The dtypes of the actor's sharded (master) parameters and of its optimizer state."""
        params = {str(p.dtype) for p in self.actor.parameters()}
        optim = {str(v.dtype) for state in self.optimizer.state.values() for k, v in state.items()
                 if isinstance(v, torch.Tensor) and k != "step"}
        return {"params": sorted(params), "optimizer": sorted(optim)}

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of actor parameters (its shards) and optimizer state, and of the rollout's
        own copy of the model (0 when generating from the actor)."""
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        params = sum(local(p).numel() * p.element_size() for p in self.actor.parameters())
        optim = sum(local(v).numel() * v.element_size() for state in self.optimizer.state.values()
                    for v in state.values() if isinstance(v, torch.Tensor))
        copy_bytes = sum(p.numel() * p.element_size() for p in self.rollout_model.parameters()) \
            if self.rollout_model is not None else 0
        ref = sum(local(p).numel() * p.element_size() for p in self.ref.parameters()) if self.ref is not None else 0
        trainable = sum(local(p).numel() * p.element_size() for p in self.actor.parameters() if p.requires_grad)
        return {"params": int(params), "trainable_params": int(trainable), "optimizer": int(optim),
                "rollout_copy": int(copy_bytes), "ref": int(ref)}

    def trainable_weights(self) -> dict[str, torch.Tensor]:
        """The full trainable parameters (LoRA: the adapters) as the weight sync gathers them."""
        return fsdp.full_state_dict(self.actor, trainable_only=True)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full actor weights on rank 0 (empty on the others); every rank joins the gather."""
        return fsdp.full_state_dict_rank0(self.actor)

    def dropout_left(self) -> dict[str, list[str]]:
        """Where each model of this rank would still drop anything (engine.models.loading.dropout_left): empty lists."""
        models = {"actor": self.actor, "rollout copy": self.rollout_model, "ref": self.ref}
        return {name: dropout_left(m) for name, m in models.items() if m is not None}

    def weights_digest(self) -> str:
        """sha256 of the full weights (for bit-identity checks); every rank joins the gather."""
        import hashlib

        digest = hashlib.sha256()
        for key, value in sorted(fsdp.full_state_dict(self.actor).items()):
            digest.update(key.encode())
            digest.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def generate_batch(rollout: Any, prompts: Batch, cfg: RolloutConfig, *, seed: int, iteration: int, rank: int,
                   do_sample: bool, version: int, draw: int = 0, tokenizer: Any = None,
                   tools: dict[str, Any] | None = None, isolation: Literal["bwrap", "none"] = "bwrap",
                   prompt_width: int = 1024, part: int = 0, max_new_tokens: int | None = None) -> Batch:
    """Responses to `prompts` in micro-batches of cfg.micro_batch_size, each sampled with a seed derived
    from (run seed, iteration, stage, draw, micro-batch, rank); the first draw's seeds leave the draw out. Adds `prompt_ids`, `responses`, `response_mask`,
    the full `input_ids` / `attention_mask` [B, P+T], the behaviour log-probs `rollout_logp` [B, T] and
    `rollout_version` [B] (the weights' version).

    Partial rollouts (rollout.partial_tokens): `max_new_tokens` bounds this call instead of the config's,
    and the batch gains `finished` [B] (the response ended with a stop token); `part` 1 is the call that
    continues responses (its prompts are the first part's sequences), a seed stage of its own."""
    params = SamplingParams(max_new_tokens or cfg.max_new_tokens, do_sample, cfg.temperature, cfg.top_p, cfg.top_k)
    stage = ("rollout" if do_sample else "rollout_greedy") + (f"/draw{draw}" if draw else "") + \
        (f"/part{part}" if part else "")
    if cfg.episodes is not None:  # assistant -> environment or agent -> assistant (engine/rollout/envs.py, agents.py)
        mt = cfg.multi_turn
        limits = EnvLimits(mt.env_step_timeout_s, mt.env_memory_mb, isolation, mt.env_rollout_timeout_s)
        seeds = [derive_seed(seed, iteration, f"{stage}/episode{r}", rank) for r in range(len(prompts))]
        episodes: EnvEpisodes = (
            EnvEpisodes(tokenizer, cfg.env, limits, width=prompt_width, error_reward=mt.env_error_reward,
                        readable=env_files(cfg.env), seeds=seeds) if cfg.env is not None else
            AgentEpisodes(tokenizer, cfg.episodes, limits, width=prompt_width, error_reward=mt.env_error_reward,
                          readable=env_files(cfg.episodes), seeds=seeds,
                          sampling=Sampling(temperature=cfg.temperature, top_p=cfg.top_p,
                                            max_tokens=cfg.max_new_tokens)))
        return run_episodes(rollout, tokenizer, episodes, prompts, cfg, seed=seed, iteration=iteration, rank=rank,
                            do_sample=do_sample, version=version, stage=stage)
    if cfg.multi_turn.enable:  # assistant -> tool -> assistant (engine/rollout/multi_turn.py)
        return generate_multi_turn(rollout, tokenizer, tools or {}, prompts, cfg, seed=seed, iteration=iteration,
                                   rank=rank, do_sample=do_sample, version=version, stage=stage,
                                   isolation=isolation)
    outs = []
    for i, micro in enumerate(prompts.chunks(cfg.micro_batch_size) if len(prompts) else []):
        micro_seed = derive_seed(seed, iteration, f"{stage}/{i}", rank)
        outs.append(rollout.generate(micro["input_ids"], micro["attention_mask"], params, micro_seed))
    responses = torch.cat([o.responses for o in outs])  # [B, T]
    response_mask = torch.cat([o.response_mask for o in outs])  # [B, T]
    finished = {}
    if max_new_tokens is not None:  # ended within the call: before its last token, or with a stop token there
        last = responses[:, -1]
        stops = torch.tensor(sorted(rollout.stop_ids), dtype=last.dtype)
        finished["finished"] = ((response_mask.sum(dim=1) < responses.shape[1]) | torch.isin(last, stops)).long()
    return prompts.with_tensors(**finished,
        prompt_ids=prompts["input_ids"],
        input_ids=torch.cat([prompts["input_ids"], responses], dim=1),  # [B, P+T]
        attention_mask=torch.cat([prompts["attention_mask"], response_mask], dim=1),  # [B, P+T]
        responses=responses,
        response_mask=response_mask,
        rollout_logp=torch.cat([o.logp for o in outs]),  # [B, T]
        rollout_version=torch.full((len(prompts),), version, dtype=torch.long),  # [B]
    )


def _upload(folder: str, url: str, storage_options: dict[str, Any]) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    fs.makedirs(path, exist_ok=True)
    fs.put(f"{folder}/", path, recursive=True)


Layout = Literal["shared", "packed", "padded"]


def response_logits(model: nn.Module, batch: Batch, temperature: float, layout: Layout = "shared") -> torch.Tensor:
    """Logits that score each response token: [B, P+T] inputs -> [B, T, V], divided by the sampling
    temperature so log-probs match the distribution the rollout sampled from (as verl does).

    `layout` (ActorConfig.forward_layout), how the rows run through the model:
    - "padded": one forward of the rows, left-padded prompts and right-padded responses. Columns that
      are padding in every row never reach the model (the shared left padding, the responses' tail past
      the longest response); real tokens get the same logits (positions count real tokens, pads are
      masked keys).
    - "shared": rows with the same prompt (a GRPO group) share one forward pass of it; see
      `_shared_prompt_logits`.
    - "packed": the rows run as one sequence without any padding; see `_packed_logits`.
    Positions past the longest response get zeros, which every loss and statistic masks out. The number
    of forward passes depends on the layout only, never on the data: under FSDP2 every forward
    all-gathers, so ranks whose micro-batches differ must still issue the same collectives.
    """
    t = batch["responses"].shape[1]
    keep = max(1, int(algos.last_index(batch["response_mask"]).max()) + 1)  # the longest response's extent
    if layout == "shared":
        out = _shared_prompt_logits(model, batch, *fsdp.prompt_groups(batch), keep)
    elif layout == "packed":
        out = _packed_logits(model, batch, keep)
    else:
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        first = _first_real_column(attention_mask)
        end = input_ids.shape[1] - t + keep
        input_ids, attention_mask = input_ids[:, first:end], attention_mask[:, first:end]
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask)).logits
        out = logits[:, -keep - 1 : -1].float()  # position j predicts token j+1
    out = out / temperature
    return F.pad(out, (0, 0, 0, t - keep)) if keep < t else out


def _packed_logits(model: nn.Module, batch: Batch, keep: int) -> torch.Tensor:
    """[B, keep, V] float logits of the rows run as one sequence (verl's use_remove_padding): no token
    is padding, so a micro-batch of rows of very different lengths costs what its real tokens cost.
    Logits past a row's response are taken from its last position; the response mask zeroes them."""
    ids, pos, index = packed_inputs(batch, keep)
    # No cache: with one, transformers would not look for packed rows in the position ids.
    logits = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits[0]  # [N, V]
    return logits[index].float()  # [B, keep, V]


def _shared_prompt_logits(model: nn.Module, batch: Batch, unique: torch.Tensor, inverse: torch.Tensor,
                          keep: int) -> torch.Tensor:
    """[B, keep, V] float logits, each distinct prompt run once: its KV cache (with its autograd graph)
    is repeated for the rows that share it, and the responses run on top of it.

    The same attention as one padded forward (each response token sees its prompt's real tokens and
    the response before it, at the same positions), so the same logits up to float rounding; with
    GRPO's 8 responses per prompt and prompts longer than responses, about half the compute. The
    backward sums each prompt's gradient over its rows, as the padded forward does.

    Always two forward passes, whatever the data (see `response_logits`): when every response has one
    token (keep = 1) the response pass still runs on one column, and its unused logits stay in the
    graph through an empty slice, so its backward (and FSDP2's collectives in it) runs as on any rank.
    """
    rows, t = batch["responses"].shape
    p = batch["input_ids"].shape[1] - t
    prompt_mask = batch["attention_mask"][:, :p]
    first_row = torch.full((len(unique),), rows).scatter_reduce(0, inverse, torch.arange(rows), "amin")
    mask = prompt_mask[first_row]  # [U, P]
    start = _first_real_column(mask)
    ids, mask = unique[:, start:], mask[:, start:]  # the left padding every prompt has: left out
    cache = DynamicCache(config=model.config)
    kwargs = {cache_argument(model): cache}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True, logits_to_keep=1,
                **kwargs)
    first = out.logits[:, -1:].float()[inverse]  # [B, 1, V]: the prompt's last position predicts token 0
    cache.batch_select_indices(inverse)  # [U, ...] -> [B, ...], differentiable (an index)
    width = max(1, keep - 1)  # token j (j < keep-1) predicts token j+1; one column at least
    ids = batch["responses"][:, :width]
    # The response's attention columns, not its response mask: a multi-turn response's observations are
    # read by the model though not trained on.
    full_mask = torch.cat([mask[inverse], batch["attention_mask"][:, p : p + width]], dim=1)
    after_prompt = mask.sum(-1)[inverse].unsqueeze(1) + torch.arange(width).unsqueeze(0)
    rest = model(input_ids=ids, attention_mask=full_mask, position_ids=after_prompt, use_cache=True, **kwargs).logits
    return torch.cat([first, rest[:, : keep - 1].float()], dim=1)


def _first_real_column(attention_mask: torch.Tensor) -> int:
    """The first column that is not padding in every row (left padding all rows share ends there)."""
    real = attention_mask.any(0).nonzero()
    return int(real[0]) if len(real) else 0
