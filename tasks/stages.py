"""One Prefect task per stage. Each is thin: read buffers, call the engine by run id, write a buffer,
return a `StageResult` (a BufferRef and metrics: small and JSON-able).

Two layers make a retried or resumed iteration skip finished work:
- Prefect: results are persisted and cached by (run id, run incarnation, iteration, stage, config
  hash), so a retried flow run gets finished tasks back `Cached`.
- Storage: a data stage whose buffer is already complete returns it instead of regenerating, and an
  update whose version the engine already holds returns its recorded metrics. This holds even when
  Prefect's result cache is gone (a new machine resuming from S3).
"""

from __future__ import annotations

import json
import time
from typing import Any

import ray
import torch
from prefect import get_run_logger, task
from prefect.context import TaskRunContext
from pydantic import BaseModel

from engine.advantage import compute_advantages as advantage_math
from engine.advantage import data_metrics
from engine.batch import Batch
from engine.errors import EngineDeadError, VersionMismatchError
from engine.models import decode_responses
from engine.rewards import score_batch
from infra.buffers import BufferRef, load_ref, read_buffer, write_buffer
from infra.errors import ObjectNotFound
from tasks.context import RunPlan, StageContext, context
from tasks.faults import maybe_fail, maybe_kill_rank, maybe_kill_uploader

RETRIES = 2
RETRY_DELAYS = [2, 10]  # seconds: a transient storage or Ray hiccup, then a longer pause
# A stage that hangs becomes a failure. Generous: the engine's own per-call timeout
# (trainer.stage_timeout_s) is what bounds a single engine call.
STAGE_TIMEOUT_S = 4 * 3600


class StageResult(BaseModel):
    """What a stage hands to the next: where its buffer is (if any) and its metrics."""

    ref: BufferRef | None = None
    metrics: dict[str, float] = {}
    reused: bool = False


def stage_cache_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    """(run id, incarnation, iteration, stage, config hash): the same stage of the same run only."""
    plan = params["plan"]
    plan = plan if isinstance(plan, RunPlan) else RunPlan.model_validate(plan)
    return f"{plan.run_id}-{plan.created}-{params['iteration']}-{ctx.task.name}-{plan.config_hash[:16]}"


def retry_unless_engine_gone(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a failed stage, except when the engine is gone or at the wrong version: only the train
    flow can restart and restore it, so the failure goes up at once."""
    try:
        state.result()
    except (EngineDeadError, VersionMismatchError):
        return False
    except BaseException:  # noqa: BLE001 - any other failure may be transient
        return True
    return True


def stage(name: str, cache: bool = True) -> Any:
    """The decorator every stage shares: retries with backoff, a timeout, persisted cached results."""
    def wrap(fn: Any) -> Any:
        options: dict[str, Any] = {"name": name, "retries": RETRIES, "retry_delay_seconds": RETRY_DELAYS,
                                   "retry_condition_fn": retry_unless_engine_gone, "persist_result": True,
                                   "timeout_seconds": STAGE_TIMEOUT_S}
        if cache:
            options["cache_key_fn"] = stage_cache_key
        else:
            options["cache_policy"] = None
        return task(**options)(fn)
    return wrap


def _reuse(ctx: StageContext, iteration: int, name: str) -> StageResult | None:
    """The complete buffer a previous attempt left, with the metrics it recorded; None if absent."""
    ref = load_ref(ctx.store, ctx.plan.run_id, iteration, name)
    if ref is None:
        return None
    batch = read_buffer(ctx.store, ref)  # verifies the content hash
    get_run_logger().info("iteration %d: reusing the %s buffer %s", iteration, name, ref.uri)
    return StageResult(ref=ref, metrics=dict(batch.meta.get("metrics", {})), reused=True)


def _write(ctx: StageContext, iteration: int, name: str, batch: Batch, metrics: dict[str, float]) -> StageResult:
    start = time.perf_counter()
    ref = write_buffer(ctx.store, ctx.plan.run_id, iteration, name, batch.with_meta(metrics=metrics))
    timings = ", ".join(f"{k.removeprefix('timing_s/')} {v:.2f} s" for k, v in metrics.items() if k.startswith("timing_s/"))
    get_run_logger().info("iteration %d: %s buffer (%d rows) written in %.2f s; %s", iteration, name, len(batch),
                          time.perf_counter() - start, timings or "no compute")
    return StageResult(ref=ref, metrics=metrics)


# -- rollout ---------------------------------------------------------------------------------------

@stage("generate_rollouts")
def generate_rollouts(plan: RunPlan, iteration: int) -> StageResult:
    """Iteration k's prompts, n sampled responses each, from the policy at version k-1."""
    ctx = context(plan)
    maybe_fail(ctx, "generate_rollouts", iteration)
    if (done := _reuse(ctx, iteration, "rollout")) is not None:
        return done
    prompts = ctx.prompt_batch(iteration)
    start = time.perf_counter()
    batch = ctx.engine().generate(prompts, iteration=iteration, expected_version=iteration - 1)
    gen_s = time.perf_counter() - start
    texts = decode_responses(ctx.tokenizer, batch["responses"])
    tokens = float(batch["response_mask"].sum())
    metrics = {"timing_s/gen": gen_s, "perf/gen_tokens": tokens, "perf/gen_tokens_per_s": tokens / gen_s}
    get_run_logger().info("iteration %d: generated %d responses in %.2f s", iteration, len(batch), gen_s)
    return _write(ctx, iteration, "rollout", batch.with_columns(response_text=texts), metrics)


@stage("generate_baseline")
def generate_baseline(plan: RunPlan, iteration: int) -> StageResult:
    """ReMax's baseline: one greedy response per prompt (Li et al. 2023, arXiv 2310.10505)."""
    ctx = context(plan)
    if (done := _reuse(ctx, iteration, "baseline")) is not None:
        return done
    prompts = ctx.prompt_batch(iteration)
    unique = prompts.index(list(range(0, len(prompts), ctx.plan.rollout.n)))  # one row per group
    start = time.perf_counter()
    out = ctx.engine().generate(unique, iteration=iteration, expected_version=iteration - 1, do_sample=False)
    texts = decode_responses(ctx.tokenizer, out["responses"])
    batch = out.with_columns(response_text=texts)
    return _write(ctx, iteration, "baseline", batch, {"timing_s/gen_baseline": time.perf_counter() - start})


# -- reward ----------------------------------------------------------------------------------------

@ray.remote(num_cpus=0)
def _score_chunk(sources: list[str], texts: list[str], truths: list[Any], extra: list[Any],
                 reward_cfg: dict[str, Any], offset: int) -> list[float]:
    from engine.config import RewardConfig

    return score_batch(sources, texts, truths, extra, cfg=RewardConfig.model_validate(reward_cfg),
                       row_offset=offset).scores


def _score(ctx: StageContext, batch: Batch) -> torch.Tensor:
    """Scores [B] of `batch["response_text"]`: in this process, or in chunks as parallel Ray tasks.

    One chunk is scored here: a Ray task for it would cost more than rule rewards take, and each
    extra num_cpus=0 task may start a worker process that competes with the next stage for the cores.
    """
    size = ctx.plan.reward.chunk_size
    if len(batch) <= size:
        return torch.tensor(score_batch(batch["data_source"], batch["response_text"], batch["ground_truth"],
                                        batch["extra_info"], cfg=ctx.plan.reward).scores, dtype=torch.float32)
    cfg = ctx.plan.reward.model_dump()
    refs = [
        _score_chunk.remote(batch["data_source"][i:i + size], batch["response_text"][i:i + size],
                            batch["ground_truth"][i:i + size], batch["extra_info"][i:i + size], cfg, i)
        for i in range(0, len(batch), size)
    ]
    scores = [s for chunk in ray.get(refs) for s in chunk]
    return torch.tensor(scores, dtype=torch.float32)


@stage("score_rewards")
def score_rewards(plan: RunPlan, iteration: int, rollout: StageResult) -> StageResult:
    """A score per response; `token_scores` [B, T] holds it at the response's last token."""
    ctx = context(plan)
    maybe_fail(ctx, "score_rewards", iteration)
    if (done := _reuse(ctx, iteration, "reward")) is not None:
        return done
    assert rollout.ref is not None
    batch = read_buffer(ctx.store, rollout.ref)
    start = time.perf_counter()
    score = _score(ctx, batch)
    mask = batch["response_mask"]
    last = (mask.sum(-1) - 1).clamp(min=0)  # index of the last response token
    token_scores = torch.zeros(mask.shape, dtype=torch.float32).scatter(1, last.unsqueeze(1), score.unsqueeze(1))
    out = Batch({"score": score, "token_scores": token_scores}, {})
    return _write(ctx, iteration, "reward", out, {"timing_s/reward": time.perf_counter() - start})


@stage("score_baseline")
def score_baseline(plan: RunPlan, iteration: int, baseline: StageResult) -> StageResult:
    """The greedy baseline's score, repeated over its group: `baseline_score` [B]."""
    ctx = context(plan)
    if (done := _reuse(ctx, iteration, "baseline_reward")) is not None:
        return done
    assert baseline.ref is not None
    batch = read_buffer(ctx.store, baseline.ref)
    start = time.perf_counter()
    per_prompt = _score(ctx, batch)
    out = Batch({"baseline_score": per_prompt.repeat_interleave(ctx.plan.rollout.n)}, {})
    return _write(ctx, iteration, "baseline_reward", out, {"timing_s/reward_baseline": time.perf_counter() - start})


# -- log-probs and values --------------------------------------------------------------------------

@stage("compute_logprobs")
def compute_logprobs(plan: RunPlan, iteration: int, rollout: StageResult) -> StageResult:
    """Old log-probs (policy), ref log-probs (when a KL term is on), values (critic)."""
    ctx = context(plan)
    maybe_fail(ctx, "compute_logprobs", iteration)
    if (done := _reuse(ctx, iteration, "logprob")) is not None:
        return done
    assert rollout.ref is not None
    batch = read_buffer(ctx.store, rollout.ref).select(
        "input_ids", "attention_mask", "responses", "response_mask")
    engine, metrics, tensors = ctx.engine(), {}, {}
    if ctx.plan.needs_old_logp:
        start = time.perf_counter()
        tensors.update(engine.compute_log_prob(batch, expected_version=iteration - 1).tensors)
        metrics["timing_s/old_log_prob"] = time.perf_counter() - start
    if ctx.plan.needs_ref:
        start = time.perf_counter()
        tensors.update(engine.compute_ref_log_prob(batch).tensors)
        metrics["timing_s/ref"] = time.perf_counter() - start
    if ctx.plan.has_critic:
        start = time.perf_counter()
        tensors.update(engine.compute_values(batch, expected_version=iteration - 1).tensors)
        metrics["timing_s/values"] = time.perf_counter() - start
    return _write(ctx, iteration, "logprob", Batch(tensors, {}), metrics)


# -- advantages ------------------------------------------------------------------------------------

@stage("compute_advantages")
def compute_advantages(plan: RunPlan, iteration: int, rollout: StageResult, reward: StageResult,
                       logprob: StageResult | None, kl_coef: float, baseline: StageResult | None = None
                       ) -> StageResult:
    """Everything the updates need in one `advantage` buffer (what a replay reads back)."""
    ctx = context(plan)
    if (done := _reuse(ctx, iteration, "advantage")) is not None:
        return done
    parts = [r for r in (rollout, reward, logprob, baseline) if r is not None]
    batch = _merge([read_buffer(ctx.store, r.ref) for r in parts if r.ref is not None])
    start = time.perf_counter()
    batch, metrics = advantage_math(batch, ctx.plan.algorithm, kl_coef)
    metrics["timing_s/adv"] = time.perf_counter() - start
    metrics.update(data_metrics(batch, ctx.plan.rollout.max_new_tokens))
    train = batch.select(*[k for k in _TRAIN_COLUMNS if k in batch])
    return _write(ctx, iteration, "advantage", train, metrics)


_TRAIN_COLUMNS = ("input_ids", "attention_mask", "responses", "response_mask", "old_logp", "ref_logp",
                  "values", "returns", "adv", "token_rewards", "token_scores", "row_index", "group_id")


def _merge(batches: list[Batch]) -> Batch:
    """Columns of several buffers of the same rows side by side (later buffers add columns)."""
    merged = batches[0]
    for other in batches[1:]:
        merged = merged.with_tensors(**{k: v for k, v in other.tensors.items() if k not in merged})
        merged = merged.with_columns(**{k: v for k, v in other.columns.items() if k not in merged})
    return merged


# -- updates ---------------------------------------------------------------------------------------

def _update(ctx: StageContext, iteration: int, role: str, advantage: BufferRef) -> dict[str, float]:
    """Apply iteration k's update once: the engine at version k already has it (return its record)."""
    record_key = ctx.runs.key("buffers", f"iter_{iteration:06d}", f"update_{role}.json")
    engine = ctx.engine()
    version = engine.versions()[role]
    if version == iteration:
        try:
            return dict(json.loads(ctx.store.get_bytes(record_key)))
        except ObjectNotFound:
            return {}
    if version != iteration - 1:
        raise VersionMismatchError(
            f"the {role} of run {ctx.plan.run_id!r} is at version {version}; iteration {iteration} needs "
            f"{iteration - 1} (the train flow reconciles this on its next run)")
    batch = read_buffer(ctx.store, advantage)
    maybe_kill_rank(ctx, engine, role, iteration)
    start = time.perf_counter()
    if role == "critic":
        metrics = engine.update_critic(batch, iteration=iteration, expected_version=iteration - 1)
        metrics["timing_s/update_critic"] = time.perf_counter() - start
    else:
        metrics = engine.update_actor(batch, iteration=iteration, expected_version=iteration - 1)
        metrics["timing_s/update_actor"] = time.perf_counter() - start - metrics.get("timing_s/weight_sync", 0.0)
    ctx.store.put_bytes(record_key, json.dumps(metrics).encode())
    get_run_logger().info("iteration %d: %s update in %.2f s", iteration, role, time.perf_counter() - start)
    return metrics


@stage("update_critic", cache=False)
def update_critic(plan: RunPlan, iteration: int, advantage: StageResult) -> StageResult:
    ctx = context(plan)
    maybe_fail(ctx, "update_critic", iteration)
    assert advantage.ref is not None
    return StageResult(metrics=_update(ctx, iteration, "critic", advantage.ref))


@stage("update_policy", cache=False)
def update_policy(plan: RunPlan, iteration: int, advantage: StageResult) -> StageResult:
    """The actor update and the train-to-generate weight sync; the engine's version becomes k."""
    ctx = context(plan)
    maybe_fail(ctx, "update_policy", iteration)
    assert advantage.ref is not None
    metrics = _update(ctx, iteration, "policy", advantage.ref)
    get_run_logger().info("iteration %d: policy updated (pg_loss %.4f)", iteration, metrics.get("actor/pg_loss", 0.0))
    return StageResult(metrics=metrics)


# -- checkpoint and validation ---------------------------------------------------------------------

@stage("save_checkpoint", cache=False)
def save_checkpoint(plan: RunPlan, iteration: int, trainer_state: dict[str, Any]) -> StageResult:
    """Sharded engine state + trainer state at step `iteration`, committed (MANIFEST, then LATEST)."""
    ctx = context(plan)
    maybe_fail(ctx, "save_checkpoint", iteration)
    ckpts = ctx.checkpoints
    if ckpts.is_committed(iteration):
        return StageResult(metrics={}, reused=True)
    start = time.perf_counter()
    staging = ckpts.begin(iteration)
    ctx.engine().save(staging, ctx.store.storage_options())
    maybe_kill_uploader(ctx, iteration)
    ckpts.write_trainer_state(iteration, trainer_state)
    ckpts.commit(iteration)  # MANIFEST, then LATEST, then retention
    seconds = time.perf_counter() - start
    get_run_logger().info("checkpoint step %d committed at %s in %.2f s", iteration, staging, seconds)
    return StageResult(metrics={"timing_s/save_checkpoint": seconds})


@stage("validate", cache=False)
def validate(plan: RunPlan, iteration: int) -> StageResult:
    """Greedy (or sampled) responses to the validation prompts, scored: `val/score/mean` and per source."""
    ctx = context(plan)
    if not ctx.plan.val_files:
        return StageResult()
    prompts = ctx.val_batch()
    start = time.perf_counter()
    out = ctx.engine().generate(prompts, iteration=iteration, expected_version=iteration,
                                do_sample=ctx.plan.rollout.val_do_sample)
    out = out.with_columns(response_text=decode_responses(ctx.tokenizer, out["responses"]))
    score = _score(ctx, out)
    metrics = {"val/score/mean": float(score.mean()), "timing_s/validate": time.perf_counter() - start,
               "val/response_length/mean": float(out["response_mask"].sum(-1).float().mean())}
    for source in sorted(set(out["data_source"])):
        rows = torch.tensor([s == source for s in out["data_source"]])
        metrics[f"val/{source}/score/mean"] = float(score[rows].mean())
    get_run_logger().info("iteration %d: validation score %.3f", iteration, metrics["val/score/mean"])
    return StageResult(metrics=metrics)
