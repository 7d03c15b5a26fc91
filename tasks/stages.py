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

import functools
import json
import time
from collections import Counter
from typing import Any, cast

import ray
import torch
from prefect import get_run_logger, task
from prefect.context import TaskRunContext
from pydantic import BaseModel

from engine.advantage import compute_advantages as advantage_math
from engine.advantage import data_metrics
from engine.algos import last_index, update_multiplier
from engine.batch import Batch, response_lengths
from engine.config import RewardConfig
from engine.errors import EngineDeadError, NonFiniteError, RewardError, VersionMismatchError
from engine.models.tokens import response_texts
from engine.rewards import score_batch
from engine.rewards.shaping import overlong_penalty
from infra.buffers import BufferRef, load_ref, read_buffer, recorded_metric, write_buffer
from infra.errors import ObjectNotFound
from infra.layout import artifact_key
from infra.records import parse_metrics
from tasks.context import RunPlan, StageContext, context
from tasks.faults import maybe_fail, maybe_kill_rank, maybe_kill_uploader
from tasks.graph import StageSpec, load_user_stage

# A stage that hangs becomes a failure. Generous: the engine's own per-call timeout
# (trainer.stage_timeout_s) is what bounds a single engine call.
STAGE_TIMEOUT_S = 4 * 3600


class StageResult(BaseModel):
    """What a stage hands to the next: where its buffer is (if any) and its metrics."""

    ref: BufferRef | None = None
    metrics: dict[str, float] = {}
    reused: bool = False
    span: tuple[float, float] | None = None  # wall-clock start and end of the work (None: reused)


def stage_cache_key(ctx: TaskRunContext, params: dict[str, Any]) -> str:
    """(run id, incarnation, iteration, stage, config hash): the same stage of the same run only."""
    plan = params["plan"]
    plan = plan if isinstance(plan, RunPlan) else RunPlan.model_validate(plan)
    return f"{plan.run_id}-{plan.created}-{params['iteration']}-{ctx.task.name}-{plan.config_hash[:16]}"


def retry_unless_engine_gone(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a failed stage, except when the engine is gone or at the wrong version: only the train
    flow can restart and restore it, so the failure goes up at once; and a non-finite loss, advantage or
    gradient, which a retry would only compute again."""
    try:
        state.result()
    except (EngineDeadError, VersionMismatchError, NonFiniteError):
        return False
    except BaseException:  # noqa: BLE001 - any other failure may be transient
        return True
    return True


def stage_task(name: str, cache: bool = True) -> Any:
    """The decorator every stage shares: the retry condition (the retries themselves are the run's:
    `with_retries`), a timeout, persisted cached results.
    Stages of the iteration graph are registered in TASKS under `name` (StageSpec.task)."""
    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            result = fn(*args, **kwargs)
            if isinstance(result, StageResult) and not result.reused:
                result.span = (start, time.time())
            return result

        # the retries and their delays are the run's (trainer.stage_retry_delays_s): with_retries sets them
        options: dict[str, Any] = {"name": name, "retry_condition_fn": retry_unless_engine_gone, "persist_result": True,
                                   "timeout_seconds": STAGE_TIMEOUT_S}
        if cache:
            options["cache_key_fn"] = stage_cache_key
        else:
            options["cache_policy"] = None
        TASKS[name] = task(**options)(timed)
        return TASKS[name]
    return wrap


TASKS: dict[str, Any] = {}


def graph_stage(name: str, cache: bool = True) -> Any:
    """A stage of the iteration graph, as a Prefect task of (plan, iteration, stage, inputs, kl_coef): the
    KL controller's coefficient is for the advantages. Every stage starts the same way: its context, an
    injected fault if the run's debug settings ask for one, and, for a stage that writes a buffer, the
    complete buffer a previous attempt left. Then `body(ctx, iteration, stage, inputs, kl_coef)`."""
    def wrap(body: Any) -> Any:
        def run(plan: RunPlan, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                kl_coef: float = 0.0) -> StageResult:
            ctx = context(plan)
            maybe_fail(ctx, stage.name, iteration)
            if stage.buffer is not None and (done := _reuse(ctx, iteration, stage)) is not None:
                return done
            return cast(StageResult, body(ctx, iteration, stage, inputs, kl_coef))

        # Prefect reads the task's parameters from `run`'s signature, so not functools.wraps (it would
        # point the signature at `body`'s).
        run.__name__, run.__qualname__, run.__doc__ = body.__name__, body.__qualname__, body.__doc__
        return stage_task(name, cache)(run)
    return wrap


def task_for(stage: StageSpec, plan: RunPlan) -> Any:
    """The Prefect task that runs `stage`, named as the stage (a user stage's task takes its name), with
    the run's retries."""
    return with_retries(TASKS[stage.task], plan, stage.name)


def with_retries(found: Any, plan: RunPlan, name: str | None = None) -> Any:
    """`found` retried as the run says (trainer.stage_retry_delays_s: one retry per delay)."""
    key = (found.name, name or found.name, tuple(plan.retry_delays_s))
    if key not in _RETRIED:
        delays = list(plan.retry_delays_s)
        _RETRIED[key] = found.with_options(name=key[1], retries=len(delays), retry_delay_seconds=delays or 0)
    return _RETRIED[key]


_RETRIED: dict[tuple[str, str, tuple[float, ...]], Any] = {}  # (task, stage name, delays): the task so retried


def _reuse(ctx: StageContext, iteration: int, stage: StageSpec) -> StageResult | None:
    """The complete buffer a previous attempt left, with the metrics it recorded; None if absent."""
    assert stage.buffer is not None
    ref = load_ref(ctx.store, ctx.plan.run_id, iteration, stage.buffer)
    if ref is None:
        return None
    batch = read_buffer(ctx.store, ref)  # verifies the content hash
    get_run_logger().info("iteration %d: reusing the %s buffer %s", iteration, stage.buffer, ref.uri)
    return StageResult(ref=ref, metrics=dict(batch.meta.get("metrics", {})), reused=True)


def _inputs(ctx: StageContext, stage: StageSpec, inputs: dict[str, StageResult]) -> Batch:
    """The Batch of the stage's declared reads, each column from the stage that wrote it last: a stage
    sees nothing it did not declare."""
    parts = []
    for source, columns in stage.sources.items():
        ref = inputs[source].ref
        if ref is None:
            raise RuntimeError(f"stage {stage.name}: its input {source} wrote no buffer")
        parts.append(read_buffer(ctx.store, ref).select(*columns))
    return _merge(parts) if parts else Batch({}, {})


def _write(ctx: StageContext, iteration: int, stage: StageSpec, batch: Batch, metrics: dict[str, float]
           ) -> StageResult:
    """The stage's buffer, which holds exactly its declared writes (the declared graph is the run one)."""
    if set(batch.keys()) != set(stage.writes):
        raise RuntimeError(f"stage {stage.name} produced columns {sorted(batch.keys())}, its declaration says "
                           f"{sorted(stage.writes)}")
    assert stage.buffer is not None
    start = time.perf_counter()
    ref = write_buffer(ctx.store, ctx.plan.run_id, iteration, stage.buffer, batch.with_meta(metrics=metrics))
    timings = ", ".join(f"{k.removeprefix('timing_s/')} {v:.2f} s" for k, v in metrics.items() if k.startswith("timing_s/"))
    get_run_logger().info("iteration %d: %s buffer (%d rows) written in %.2f s; %s", iteration, stage.buffer,
                          len(batch), time.perf_counter() - start, timings or "no compute")
    return StageResult(ref=ref, metrics=metrics)


def _merge(batches: list[Batch]) -> Batch:
    """Columns of several buffers of the same rows side by side (later buffers add columns)."""
    merged = batches[0]
    for other in batches[1:]:
        merged = merged.with_tensors(**{k: v for k, v in other.tensors.items() if k not in merged})
        merged = merged.with_columns(**{k: v for k, v in other.columns.items() if k not in merged})
    return merged


# -- rollout ---------------------------------------------------------------------------------------

@graph_stage("generate_rollouts")
def generate_rollouts(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                      kl_coef: float) -> StageResult:
    """Iteration k's prompts, n sampled responses each, from the policy at version k-1."""
    version = ctx.rollout_version(iteration)
    start = time.perf_counter()
    partial = ctx.plan.rollout.partial_tokens
    if ctx.plan.algorithm.filter_groups:
        batch, metrics = _dynamic_sampling(ctx, iteration, stage, version)
        tokens = metrics["perf/gen_tokens"]
    elif partial is not None:  # the first part of partial rollouts: continue_rollouts samples the rest
        batch = ctx.engine(stage.name).generate(ctx.prompt_batch(iteration), iteration=iteration,
                                                expected_version=version, max_new_tokens=partial)
        tokens = float(batch["response_mask"].sum())
        metrics = {"async/partial_rows": float(1 - batch["finished"].float().mean())}
    else:
        batch = ctx.engine(stage.name).generate(ctx.prompt_batch(iteration), iteration=iteration,
                                                expected_version=version)
        batch = batch.with_columns(response_text=response_texts(ctx.tokenizer, batch))
        tokens = float(batch["response_mask"].sum())
        metrics = {}
    gen_s = time.perf_counter() - start
    if "tool_calls" in batch:
        metrics.update(tool_metrics(batch, "tools"))
    if "env_errors" in batch:
        metrics.update(env_metrics(batch, "env"))  # its table: flows.train.rl_iteration (a reused rollout's too)
    metrics.update({"timing_s/gen": gen_s, "perf/gen_tokens": tokens, "perf/gen_tokens_per_s": tokens / gen_s,
                    "async/rollout_version": float(version), "async/staleness": float(iteration - 1 - version)})
    get_run_logger().info("iteration %d: generated %d responses in %.2f s with the weights of version %d",
                          iteration, len(batch), gen_s, version)
    return _write(ctx, iteration, stage, batch, metrics)


@graph_stage("continue_rollouts")
def continue_rollouts(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                      kl_coef: float) -> StageResult:
    """Partial rollouts (rollout.partial_tokens): the responses generate_rollouts left unfinished go on
    from where they stopped with the weights of version max(0, i-k), which the schedule synced in while
    they waited (flows/pipeline.py), up to rollout.max_new_tokens in all. Each token's version is kept
    (`token_version` [B, T]); its behaviour log-prob is that version's, so the rollout correction weighs
    every token by the weights that sampled it."""
    from engine.rollout.partial import continuation_prompts, join_parts

    head = _inputs(ctx, stage, inputs)
    version = ctx.continue_version(iteration)
    first, total = head["responses"].shape[1], ctx.plan.rollout.max_new_tokens
    going = continuation_prompts(head)
    start = time.perf_counter()
    tail = None
    if len(going):
        tail = ctx.engine(stage.name).generate(going, iteration=iteration, expected_version=version, part=1,
                                               max_new_tokens=total - first)
    gen_s = time.perf_counter() - start
    batch = join_parts(head, tail, total, int(ctx.tokenizer.pad_token_id), version)
    batch = batch.with_columns(response_text=response_texts(ctx.tokenizer, batch))
    mask = batch["response_mask"]
    later = float(mask[:, first:].sum())
    metrics = {"timing_s/gen_continue": gen_s, "async/continue_version": float(version),
               "async/continued_token_fraction": later / max(1.0, float(mask.sum())),
               "perf/gen_tokens": float(mask.sum())}
    get_run_logger().info("iteration %d: continued %d of %d responses in %.2f s with the weights of version %d "
                          "(%d tokens after the first %d)", iteration, len(going), len(head), gen_s, version, int(later), first)
    return _write(ctx, iteration, stage, batch, metrics)


@graph_stage("load_conversations")
def load_conversations(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                       kl_coef: float) -> StageResult:
    """algorithm.objective=sft: iteration k's conversations (the sampler's step k-1) as training rows, the
    loss on their assistant tokens only (engine.data.conversations)."""
    indices = ctx.sampler_at(iteration - 1).next_indices()
    batch = ctx.conversations("train", indices)
    trained, real = float(batch["response_mask"].sum()), float(batch["attention_mask"].sum())
    metrics = {"sft/trained_tokens": trained, "sft/tokens": real, "sft/trained_share": trained / real}
    get_run_logger().info("iteration %d: %d conversations, %d of their %d tokens trained", iteration, len(batch),
                          int(trained), int(real))
    return _write(ctx, iteration, stage, batch, metrics)


@graph_stage("load_preferences")
def load_preferences(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                     kl_coef: float) -> StageResult:
    """algorithm.objective=dpo: iteration k's preference pairs (the sampler's step k-1) as training rows,
    each holding its chosen and its rejected response (engine.data.preferences)."""
    indices = ctx.sampler_at(iteration - 1).next_indices()
    batch = ctx.conversations("train", indices)
    metrics = {"dpo/chosen_tokens": float(batch["response_mask"].sum()),
               "dpo/rejected_tokens": float(batch["rejected_response_mask"].sum())}
    get_run_logger().info("iteration %d: %d preference pairs", iteration, len(batch))
    return _write(ctx, iteration, stage, batch, metrics)


def tool_metrics(batch: Batch, prefix: str) -> dict[str, float]:
    """Multi-turn rollouts: how often the responses call tools, and how often a call gets an error."""
    calls, errors = batch["tool_calls"].float(), batch["tool_errors"].float()
    return {f"{prefix}/call_rate": float((calls > 0).float().mean()), f"{prefix}/calls_per_response": float(calls.mean()),
            f"{prefix}/error_rate": float(errors.sum() / calls.sum()) if float(calls.sum()) else 0.0}


EPISODES_SHOWN = 64  # the episodes table's rows at most (the rollout buffer holds them all)


def episodes_table(run_id: str, iteration: int, batch: Batch) -> None:
    """rollout.env: the iteration's episodes as a table artifact on its flow run (the Prefect UI's
    iteration page): each episode's turns, steps, reward and error, and the training row it became
    (its tokens trained on and its observation tokens, holes in the mask)."""
    from prefect.artifacts import create_table_artifact

    p = batch["prompt_ids"].shape[1]
    real, trained = batch["attention_mask"][:, p:].bool(), batch["response_mask"].bool()
    rows = []
    for i in range(min(len(batch), EPISODES_SHOWN)):
        turns = " | ".join(f"{t['role']}: {t['content']}" for t in json.loads(batch["turns"][i]))
        rows.append({"episode": i, "row": int(batch["row_index"][i]), "steps": int(batch["env_steps"][i]),
                     "reward": round(float(batch["env_reward"][i]), 6), "error": batch["env_error"][i],
                     "turns": turns if len(turns) <= 400 else turns[:397] + "...",
                     "trained_tokens": int(trained[i].sum()), "observation_tokens": int((real[i] & ~trained[i]).sum())})
    create_table_artifact(rows, key=artifact_key(run_id, "episodes"),
                          description=f"{run_id}: the episodes of iteration {iteration} (the first {len(rows)} of "
                                      f"{len(batch)}; all in its rollout buffer)")


def env_metrics(batch: Batch, prefix: str) -> dict[str, float]:
    """rollout.env: the episodes' reward, steps, and how many ended as an error (the first few named in
    the log)."""
    errors = batch["env_errors"].float()
    late = [i for i, why in enumerate(batch["env_error"]) if "env_rollout_timeout_s" in why]
    failed = [(i, why) for i, why in enumerate(batch["env_error"]) if why and i not in late]
    for i, why in failed[:3]:
        get_run_logger().warning("episode %d ended as an error: %s", i, why)
    if late:
        get_run_logger().warning("%d episodes ran past the rollout's deadline (rollout.multi_turn.env_rollout_timeout_s)"
                                 " and ended as errors: rows %s", len(late), ", ".join(map(str, late)))
    return {f"{prefix}/reward/mean": float(batch["env_reward"].mean()), f"{prefix}/steps/mean":
            float(batch["env_steps"].float().mean()), f"{prefix}/errors": float(errors.sum()),
            f"{prefix}/error_rate": float(errors.mean()), f"{prefix}/late": float(len(late))}


def _dynamic_sampling(ctx: StageContext, iteration: int, stage: StageSpec, version: int
                      ) -> tuple[Batch, dict[str, float]]:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2): draw the sampler's next
    prompts, generate, score, and keep the groups whose rewards differ, until data.train_batch_size
    groups are kept or algorithm.max_num_gen_batches batches were drawn; a batch still short is filled
    with the last dropped groups. The iteration starts at the sampler step where the previous one ended
    (recorded in its rollout buffer as sampling/next_step), so a replay draws the same prompts."""
    want, n = ctx.plan.data.train_batch_size, ctx.plan.rollout.n
    step = sampler_start(ctx, iteration)
    engine = ctx.engine(stage.name)
    kept: list[Batch] = []
    dropped: list[Batch] = []
    drawn = tokens = 0.0
    draws = 0
    while sum(len(b) for b in kept) < want * n and draws < ctx.plan.algorithm.max_num_gen_batches:
        out = engine.generate(ctx.prompts_at_step(step), iteration=iteration, expected_version=version, draw=draws)
        step, draws = step + 1, draws + 1
        out = out.with_columns(response_text=response_texts(ctx.tokenizer, out))
        tokens += float(out["response_mask"].sum())
        drawn += len(out) // n
        rule, penalty, _ = rule_scores(ctx, out)
        varied = (rule + penalty).view(-1, n).std(dim=1) > 0  # one flag per group
        for g in range(len(varied)):
            (kept if bool(varied[g]) else dropped).append(out.index(list(range(g * n, (g + 1) * n))))
    kept_groups = min(len(kept), want)
    filled = dropped[-(want - kept_groups):] if kept_groups < want else []
    if filled:
        get_run_logger().warning("iteration %d: dynamic sampling kept %d of %d groups after %d batches "
                                 "(algorithm.max_num_gen_batches); %d dropped groups fill the batch", iteration,
                                 kept_groups, want, draws, len(filled))
    groups = (kept[:want] + filled)[:want]
    width = max(g["prompt_ids"].shape[1] for g in groups)  # draws pad their prompts to their own longest
    batch = Batch.concat([left_pad_prompts(g, width, ctx.tokenizer.pad_token_id) for g in groups])
    batch = batch.with_tensors(group_id=torch.arange(want, dtype=torch.long).repeat_interleave(n))
    metrics = {"sampling/gen_batches": float(draws), "sampling/groups_drawn": drawn,
               "sampling/groups_kept": float(kept_groups), "sampling/groups_filled": float(len(filled)),
               "sampling/next_step": float(step), "perf/gen_tokens": tokens}
    get_run_logger().info("iteration %d: dynamic sampling kept %d of %d groups drawn in %d batches "
                          "(sampler steps %d..%d)", iteration, len(kept), int(drawn), draws, step - draws, step - 1)
    return batch, metrics


def left_pad_prompts(batch: Batch, width: int, pad_id: int) -> Batch:
    """A rollout batch with its prompts left padded to `width` tokens (attention 0 on the padding)."""
    extra = width - batch["prompt_ids"].shape[1]
    if extra == 0:
        return batch
    pad = torch.nn.functional.pad
    return batch.with_tensors(prompt_ids=pad(batch["prompt_ids"], (extra, 0), value=pad_id),
                              input_ids=pad(batch["input_ids"], (extra, 0), value=pad_id),
                              attention_mask=pad(batch["attention_mask"], (extra, 0), value=0))


def sampler_start(ctx: StageContext, iteration: int) -> int:
    """The sampler step iteration `iteration`'s rollout draws first under dynamic sampling: where the
    previous iteration's rollout ended (its buffer's record), 0 for the first."""
    if iteration == 1:
        return 0
    return int(recorded_before(ctx, iteration, "rollout", "sampling/next_step",
                               f"dynamic sampling: iteration {iteration} draws from the sampler step where "
                               f"iteration {iteration - 1}'s rollout ended"))


def recorded_before(ctx: StageContext, iteration: int, buffer: str, metric: str, why: str) -> float:
    """The metric iteration `iteration` - 1 recorded in its `buffer` buffer; `why` it is needed goes in the
    error when that buffer is not in storage."""
    ref = load_ref(ctx.store, ctx.plan.run_id, iteration - 1, buffer)
    if ref is None:
        raise RuntimeError(f"{why}, and that iteration's {buffer} buffer is not in storage")
    return recorded_metric(ctx.store, ref, metric, why)


@graph_stage("generate_baseline")
def generate_baseline(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                      kl_coef: float) -> StageResult:
    """ReMax's baseline (Li et al. 2023, arXiv 2310.10505): one greedy response per prompt, repeated
    over the prompt's group so its rows line up with the rollout's."""
    n = ctx.plan.rollout.n
    prompts = ctx.prompt_batch(iteration)
    unique = prompts.index(list(range(0, len(prompts), n)))  # one row per group
    start = time.perf_counter()
    out = ctx.engine(stage.name).generate(unique, iteration=iteration, expected_version=ctx.rollout_version(iteration),
                                do_sample=False)
    seconds = time.perf_counter() - start
    texts = response_texts(ctx.tokenizer, out)
    batch = Batch({"baseline_responses": out["responses"].repeat_interleave(n, dim=0),
                   "baseline_response_mask": out["response_mask"].repeat_interleave(n, dim=0)},
                  {"baseline_response_text": [t for t in texts for _ in range(n)]})
    return _write(ctx, iteration, stage, batch, {"timing_s/gen_baseline": seconds})


# -- reward ----------------------------------------------------------------------------------------

@ray.remote(num_cpus=0)
def _score_chunk(sources: list[str], texts: list[str], truths: list[Any], extra: list[Any],
                 reward_cfg: dict[str, Any], offset: int) -> tuple[list[float], dict[str, int]]:
    from engine.config import RewardConfig

    scored = score_batch(sources, texts, truths, extra, cfg=RewardConfig.model_validate(reward_cfg), row_offset=offset)
    return scored.scores, scored.counts()


def _score(ctx: StageContext, batch: Batch, text_key: str = "response_text", cfg: RewardConfig | None = None,
           statuses: dict[str, int] | None = None) -> tuple[torch.Tensor, int]:
    """(scores [B] of `batch[text_key]` by `cfg` (the run's reward by default), the chunks they were
    scored in): one chunk in this process, or reward.chunk_size rows a chunk as parallel Ray tasks.
    `statuses`, when given, receives how many rows each status the reward reported had (right, wrong,
    no_answer, timeout, ...: a verifier's partial credit is not an exact answer, so a score's mean is not
    the share right).

    One chunk is scored here: a Ray task for it would cost more than rule rewards take, and each
    extra num_cpus=0 task may start a worker process that competes with the next stage for the cores.
    """
    if "env_reward" in batch and cfg is None and text_key == "response_text":  # rollout.env: the episodes' reward
        return batch["env_reward"].float(), 0
    cfg = cfg or ctx.plan.reward
    size = cfg.chunk_size
    counts: Counter[str] = Counter()
    if len(batch) <= size:
        scored = score_batch(batch["data_source"], batch[text_key], batch["ground_truth"], batch["extra_info"], cfg=cfg)
        scores, chunks = scored.scores, 1
        counts.update(scored.counts())
    else:
        dumped = cfg.model_dump()
        refs = [
            _score_chunk.remote(batch["data_source"][i:i + size], batch[text_key][i:i + size],
                                batch["ground_truth"][i:i + size], batch["extra_info"][i:i + size], dumped, i)
            for i in range(0, len(batch), size)
        ]
        scores, chunks = [], len(refs)
        for chunk_scores, chunk_counts in ray.get(refs):
            scores += chunk_scores
            counts.update(chunk_counts)
    if statuses is not None:
        statuses.update(counts)
    return torch.tensor(scores, dtype=torch.float32), chunks


def status_shares(counts: dict[str, int], rows: int, prefix: str) -> dict[str, float]:
    """`{prefix}/status/{name}`: the share of the rows whose reward reported that status."""
    return {f"{prefix}/status/{name}": count / rows for name, count in sorted(counts.items())}


def rule_scores(ctx: StageContext, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(the rule reward of each response, DAPO's overlong shaping penalty (zeros when off), its metrics)."""
    statuses: dict[str, int] = {}
    rule, chunks = _score(ctx, batch, statuses=statuses)
    metrics = {"reward/score_chunks": float(chunks), **status_shares(statuses, len(batch), "reward")}
    if not ctx.plan.reward.overlong_buffer_len:
        return rule, torch.zeros_like(rule), metrics
    penalty = overlong_penalty(response_lengths(batch), ctx.plan.rollout.max_new_tokens,
                               ctx.plan.reward.overlong_buffer_len, ctx.plan.reward.overlong_penalty_factor)
    return rule, penalty, {**metrics, "reward/overlong_penalty_mean": float(penalty.mean()),
                           "reward/overlong_share": float((penalty < 0).float().mean())}


@graph_stage("score_rewards")
def score_rewards(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                  kl_coef: float) -> StageResult:
    """A score per response; `token_scores` [B, T] holds it at the response's last token."""
    batch = _inputs(ctx, stage, inputs)
    start = time.perf_counter()
    rule, penalty, metrics = rule_scores(ctx, batch)
    score = rule + penalty
    columns = {}
    model = ctx.plan.reward.model
    if model.path is not None:  # the learned reward model, weighed with the rule (shaping stays on top)
        rm = ctx.engine(stage.name).score_responses(Batch(
            {"row_index": batch["row_index"]},
            {"prompt_json": [json.dumps(ctx.dataset("train")[i].prompt) for i in batch["row_index"].tolist()],
             "response_text": batch["response_text"]}))["rm_score"]
        score = ctx.plan.reward.rule_weight * rule + model.weight * rm + penalty
        columns = {"rule_score": rule, "rm_score": rm}
        metrics.update({"reward/rule/mean": float(rule.mean()), "reward/rm/mean": float(rm.mean()),
                        "reward/rm/std": float(rm.std()) if len(rm) > 1 else 0.0,
                        "timing_s/reward_model": time.perf_counter() - start})
    token_scores = at_last_token(score, batch["response_mask"])
    if "env_token_rewards" in batch:  # each step's reward at its own turn's last token, the rest at the end
        weight = ctx.plan.reward.rule_weight if model.path is not None else 1.0
        token_scores = at_last_token(score - weight * rule, batch["response_mask"]) + \
            weight * batch["env_token_rewards"].float()
    out = Batch({"score": score, "token_scores": token_scores, **columns}, {})
    return _write(ctx, iteration, stage, out, {"timing_s/reward": time.perf_counter() - start, **metrics})


@graph_stage("score_costs")
def score_costs(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                kl_coef: float) -> StageResult:
    """Safe RL: a cost per response, `cost` [B], by reward.cost_function (scored as a reward is)."""
    batch = _inputs(ctx, stage, inputs)
    start = time.perf_counter()
    cfg = ctx.plan.reward.model_copy(update={"function": ctx.plan.reward.cost_function})
    cost, _ = _score(ctx, batch, cfg=cfg)
    return _write(ctx, iteration, stage, Batch({"cost": cost}, {}),
                  {"timing_s/cost": time.perf_counter() - start, "safety/cost/mean": float(cost.mean())})


def multiplier_before(ctx: StageContext, iteration: int) -> float:
    """Safe RL: the Lagrange multiplier after iteration `iteration` - 1 (algorithm.lagrange_init before
    the first), as that iteration's advantage buffer recorded it."""
    if iteration == 1:
        return ctx.plan.algorithm.lagrange_init
    return recorded_before(ctx, iteration, "advantage", "safety/lambda",
                           f"safe RL: iteration {iteration} updates the Lagrange multiplier of iteration {iteration - 1}")


@graph_stage("score_baseline")
def score_baseline(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                   kl_coef: float) -> StageResult:
    """The greedy baseline's score, scored once per group and repeated over it: `baseline_score` [B]."""
    n = ctx.plan.rollout.n
    batch = _inputs(ctx, stage, inputs)
    start = time.perf_counter()
    per_prompt, _ = _score(ctx, batch.index(list(range(0, len(batch), n))), text_key="baseline_response_text")
    out = Batch({"baseline_score": per_prompt.repeat_interleave(n)}, {})
    return _write(ctx, iteration, stage, out, {"timing_s/reward_baseline": time.perf_counter() - start})


@graph_stage("user")
def run_user_stage(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                   kl_coef: float) -> StageResult:
    """A stage of `algorithm.extra_stages`: the user's function on its declared reads."""
    assert stage.function is not None
    fn, _ = load_user_stage(stage.function)
    batch = _inputs(ctx, stage, inputs)
    start = time.perf_counter()
    out = fn(batch)
    metrics = {f"timing_s/{stage.name}": time.perf_counter() - start}
    if stage.reward_weight is not None:
        score = out[stage.writes[0]]
        if not isinstance(score, torch.Tensor) or score.shape != (len(batch),) or not bool(score.isfinite().all()):
            raise RewardError(f"stage {stage.name} ({stage.function}) must return one finite score per response "
                              f"in {stage.writes[0]!r}: a tensor of shape ({len(batch)},)")
        metrics[f"reward/{stage.name}/mean"] = float(score.float().mean())
    return _write(ctx, iteration, stage, out, metrics)


def at_last_token(score: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, T] zeros with each score at its response's last token."""
    last = last_index(response_mask)
    return torch.zeros(response_mask.shape, dtype=torch.float32).scatter(1, last.unsqueeze(1), score.float().unsqueeze(1))


# -- log-probs and values --------------------------------------------------------------------------

def _forward(call: Any, timing: str) -> Any:
    """A stage that runs one forward pass of the engine over its inputs and writes what it returns."""
    def body(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
             kl_coef: float) -> StageResult:
        batch = _inputs(ctx, stage, inputs)
        start = time.perf_counter()
        out = call(ctx.engine(stage.name), batch, iteration)
        metrics = {timing: time.perf_counter() - start}
        if "micro_batches" in out.meta:  # how the pass was cut (every rank runs as many)
            metrics[f"perf/{timing.removeprefix('timing_s/')}_micro_batches"] = float(out.meta["micro_batches"])
        return _write(ctx, iteration, stage, Batch(out.tensors, {}), metrics)
    return body


def _pair_log_probs(engine: Any, batch: Batch, version: int | None) -> Batch:
    """algorithm.objective=dpo: the log-probs [B, T] of both responses of each pair under the frozen
    reference (version None: `ref_logp`, `rejected_ref_logp`) or the policy at `version` (`logp`,
    `rejected_logp`)."""
    from engine.data.preferences import SEQUENCE_COLUMNS, rejected_view

    outs = []
    for side in (batch.select(*SEQUENCE_COLUMNS), rejected_view(batch)):
        outs.append(engine.compute_ref_log_prob(side)["ref_logp"] if version is None else
                    engine.compute_log_prob(side, expected_version=version)["old_logp"])
    name = "ref_logp" if version is None else "logp"
    return Batch({name: outs[0], f"rejected_{name}": outs[1]}, {})


# `old_logp` and `entropy` [B, T] under the policy that generated (version k-1); `ref_logp` [B, T] under
# the frozen reference policy; `values` [B, T] of the critic at version k-1; DPO's pairs: `ref_logp` and
# `rejected_ref_logp` [B, T] under the reference.
for _task, _call, _timing in (
    ("compute_old_logprobs", lambda engine, batch, k: engine.compute_log_prob(batch, expected_version=k - 1),
     "timing_s/old_log_prob"),
    ("compute_ref_logprobs", lambda engine, batch, k: engine.compute_ref_log_prob(batch), "timing_s/ref"),
    ("compute_values", lambda engine, batch, k: engine.compute_values(batch, expected_version=k - 1),
     "timing_s/values"),
    ("compute_pair_ref_logprobs", lambda engine, batch, k: _pair_log_probs(engine, batch, None), "timing_s/ref"),
    ("compute_teacher_logprobs", lambda engine, batch, k: engine.compute_teacher_log_prob(batch), "timing_s/teacher"),
):
    graph_stage(_task)(_forward(_call, _timing))


# -- advantages ------------------------------------------------------------------------------------

@graph_stage("compute_advantages")
def compute_advantages(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                       kl_coef: float) -> StageResult:
    """Everything the updates need in one `advantage` buffer (what a replay reads back)."""
    batch = _inputs(ctx, stage, inputs)
    extra = {s.writes[0]: s.reward_weight for s in ctx.plan.stages if s.reward_weight is not None}
    start = time.perf_counter()
    safety: dict[str, float] = {}
    algo = ctx.plan.algorithm
    if algo.cost_limit is not None:  # the Lagrangian's reward, with lambda stepped on this iteration's cost
        mean_cost = float(batch["cost"].float().mean())
        lam = update_multiplier(multiplier_before(ctx, iteration), mean_cost, algo.cost_limit, algo.lagrange_lr,
                                algo.lagrange_max)
        safety = {"safety/lambda": lam, "safety/cost/mean": mean_cost, "safety/cost_excess": mean_cost - algo.cost_limit}
    batch, metrics = advantage_math(batch, ctx.plan.algorithm, kl_coef, extra_scores=extra,
                                    cost_coef=safety.get("safety/lambda"))
    metrics.update(safety)
    metrics["timing_s/adv"] = time.perf_counter() - start
    metrics.update(data_metrics(batch, ctx.plan.rollout.max_new_tokens))
    return _write(ctx, iteration, stage, batch.select(*stage.writes), metrics)


# -- updates ---------------------------------------------------------------------------------------

def _update(ctx: StageContext, iteration: int, role: str, stage: StageSpec, inputs: dict[str, StageResult]
            ) -> dict[str, float]:
    """Apply iteration k's update once: the engine at version k already has it (return its record)."""
    record_key = ctx.runs.key("buffers", f"iter_{iteration:06d}", f"update_{role}.json")
    engine = ctx.engine(stage.name)
    version = engine.versions()[role]
    if version == iteration:
        try:
            return dict(parse_metrics(ctx.store.get_bytes(record_key), ctx.store.url(record_key)))
        except ObjectNotFound:
            return {}
    if version != iteration - 1:
        raise VersionMismatchError(
            f"the {role} of run {ctx.plan.run_id!r} is at version {version}; iteration {iteration} needs "
            f"{iteration - 1} (the train flow reconciles this on its next run)")
    batch = update_inputs(ctx, iteration, stage, inputs)
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


def update_inputs(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult]) -> Batch:
    """What an update reads (`_inputs`), refused with NonFiniteError when a float column holds NaN or inf
    where the loss reads it (under response_mask, for the [B, T] columns): advantages, returns, log-probs
    and values from storage never reach the optimizer unchecked."""
    batch = _inputs(ctx, stage, inputs)
    for key in batch.tensor_keys:
        found = non_finite_row(batch, key)
        if found is not None:
            source = next(src for src, columns in stage.sources.items() if key in columns)
            ref = inputs[source].ref
            raise NonFiniteError(f"iteration {iteration}: {key} is not finite in row {found} of "
                                 f"{ref.uri if ref else source}; {stage.name} refuses it")
    return batch


def non_finite_row(batch: Batch, key: str) -> int | None:
    """The first row where float tensor `key` is NaN or inf (within response_mask when it is [B, T]), or None."""
    t = batch[key]
    assert isinstance(t, torch.Tensor)
    if not t.is_floating_point() or t.numel() == 0:
        return None
    bad = ~torch.isfinite(t)
    mask = batch["response_mask"] if "response_mask" in batch and key != "response_mask" else None
    if isinstance(mask, torch.Tensor) and mask.shape == t.shape:
        bad &= mask.bool()
    rows = bad.reshape(len(batch), -1).any(dim=1).nonzero()  # [B, ...] -> [B]
    return int(rows[0]) if len(rows) else None


@graph_stage("update_critic", cache=False)
def update_critic(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                  kl_coef: float) -> StageResult:
    return StageResult(metrics=_update(ctx, iteration, "critic", stage, inputs))


@graph_stage("update_policy", cache=False)
def update_policy(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                  kl_coef: float) -> StageResult:
    """The actor update and the train-to-generate weight sync; the engine's version becomes k."""
    metrics = _update(ctx, iteration, "policy", stage, inputs)
    get_run_logger().info("iteration %d: policy updated (pg_loss %.4f)", iteration, metrics.get("actor/pg_loss", 0.0))
    return StageResult(metrics=metrics)


@graph_stage("sync_weights", cache=False)
def sync_weights(ctx: StageContext, iteration: int, stage: StageSpec, inputs: dict[str, StageResult],
                 kl_coef: float) -> StageResult:
    """placement.mode=split: the weights of version k from the training pool to the rollout pool, once
    (a rollout pool at version k already has them)."""
    engine = ctx.engine(stage.name)
    versions = engine.versions()
    if versions["rollout"] == iteration:
        return StageResult(reused=True)
    if versions["rollout"] != iteration - 1:
        raise VersionMismatchError(f"the rollout pool of run {ctx.plan.run_id!r} is at version {versions['rollout']}; "
                                   f"the weight sync of iteration {iteration} needs {iteration - 1}")
    metrics = engine.sync_weights(iteration)
    get_run_logger().info("iteration %d: weights of version %d sent to the rollout pool: %.1f MB in %.2f s",
                          iteration, iteration, metrics["perf/weight_sync_mb"], metrics["timing_s/weight_sync"])
    return StageResult(metrics=metrics)


# -- checkpoint and validation ---------------------------------------------------------------------

def _validate_dpo(ctx: StageContext, iteration: int) -> StageResult:
    """algorithm.objective=dpo: on the held-out pairs, the share the policy ranks right (its implicit reward
    of the chosen response above the rejected one's, as TRL's rewards/accuracies: 0 before training, where
    policy and reference are one; and its likelihood of the chosen one above the rejected one's), the mean
    margin and the loss."""
    from engine.algos import preference_loss, sequence_logp

    start = time.perf_counter()
    engine = ctx.engine("validate")
    rows, size, algo = ctx.dataset("val"), ctx.plan.data.val_batch_size, ctx.plan.algorithm
    parts: dict[str, list[torch.Tensor]] = {}
    for first in range(0, len(rows), size):
        pairs = ctx.conversations("val", list(range(first, min(first + size, len(rows)))))
        out = _pair_log_probs(engine, pairs, iteration).with_tensors(**_pair_log_probs(engine, pairs, None).tensors)
        masks = {"": pairs["response_mask"], "rejected_": pairs["rejected_response_mask"]}
        for key in ("logp", "rejected_logp", "ref_logp", "rejected_ref_logp"):
            mask = masks["rejected_" if "rejected" in key else ""]
            parts.setdefault(key, []).append(sequence_logp(out[key], mask))
            parts.setdefault(f"loss_{key}", []).append(sequence_logp(out[key], mask, algo.ipo_logratio))
    sums = {k: torch.cat(v) for k, v in parts.items()}  # loss_*: as the update's loss reads them (IPO's mean)
    losses, stats = preference_loss(chosen_logp=sums["loss_logp"], rejected_logp=sums["loss_rejected_logp"],
                                    ref_chosen_logp=sums["loss_ref_logp"],
                                    ref_rejected_logp=sums["loss_rejected_ref_logp"],
                                    beta=algo.dpo_beta, kind=algo.dpo_loss)
    metrics = {"val/preference_accuracy": float(stats["rewards/accuracy"].mean()),
               # the policy alone: its likelihood of the chosen response above the rejected one's
               "val/likelihood_accuracy": float((sums["logp"] > sums["rejected_logp"]).float().mean()),
               "val/reward_margin": float(stats["rewards/margin"].mean()), "val/dpo_loss": float(losses.mean()),
               "timing_s/validate": time.perf_counter() - start}
    get_run_logger().info("iteration %d: validation preference accuracy %.3f", iteration, metrics["val/preference_accuracy"])
    return StageResult(metrics=metrics)


def _validate_sft(ctx: StageContext, iteration: int) -> StageResult:
    """algorithm.objective=sft: the loss on the validation conversations' assistant tokens, `val/loss` (the
    mean over all their tokens), and per source."""
    start = time.perf_counter()
    engine = ctx.engine("validate")
    rows = ctx.dataset("val")
    size = ctx.plan.data.val_batch_size
    logps, sources = [], []
    for first in range(0, len(rows), size):
        chunk = ctx.conversations("val", list(range(first, min(first + size, len(rows)))))
        logp, trained = engine.compute_log_prob(chunk, expected_version=iteration)["old_logp"], chunk["response_mask"].bool()
        for r, i in enumerate(chunk["row_index"].tolist()):
            logps.append(logp[r][trained[r]])
            sources.append(rows[i].data_source)
    metrics = {"val/loss": -float(torch.cat(logps).mean()), "timing_s/validate": time.perf_counter() - start}
    for source in sorted(set(sources)):
        metrics[f"val/{source}/loss"] = -float(torch.cat([lp for lp, s in zip(logps, sources) if s == source]).mean())
    get_run_logger().info("iteration %d: validation loss %.4f", iteration, metrics["val/loss"])
    return StageResult(metrics=metrics)


@stage_task("save_checkpoint", cache=False)
def save_checkpoint(plan: RunPlan, iteration: int, trainer_state: dict[str, Any]) -> StageResult:
    """Sharded engine state + trainer state at step `iteration`, committed (MANIFEST, then LATEST)."""
    ctx = context(plan)
    maybe_fail(ctx, "save_checkpoint", iteration)
    ckpts = ctx.checkpoints
    if ckpts.is_committed(iteration):
        return StageResult(metrics={}, reused=True)
    start = time.perf_counter()
    staging = ckpts.begin(iteration)
    written = ctx.engine("save_checkpoint").save(staging, ctx.store.storage_options())  # hashed by the ranks as they wrote
    maybe_kill_uploader(ctx, iteration)
    ckpts.write_trainer_state(iteration, trainer_state)
    ckpts.commit(iteration, written)  # MANIFEST from those hashes, then LATEST, then retention
    seconds = time.perf_counter() - start
    mb = sum(int(r["size"]) for r in written) / 2**20
    get_run_logger().info("checkpoint step %d committed at %s in %.2f s", iteration, staging, seconds)
    return StageResult(metrics={"timing_s/save_checkpoint": seconds, "checkpoint/mb": mb})


@stage_task("validate", cache=False)
def validate(plan: RunPlan, iteration: int) -> StageResult:
    """Greedy (or sampled) responses to the validation prompts, scored: `val/score/mean` and per source."""
    ctx = context(plan)
    if not ctx.plan.val_files:
        return StageResult()
    if ctx.plan.algorithm.objective == "sft":
        return _validate_sft(ctx, iteration)
    if ctx.plan.algorithm.objective == "dpo":
        return _validate_dpo(ctx, iteration)
    prompts = ctx.val_batch()
    start = time.perf_counter()
    engine = ctx.engine("validate")
    out = Batch.concat([engine.generate(chunk, iteration=iteration, expected_version=iteration,
                                        do_sample=ctx.plan.rollout.val_do_sample, pool="policy")
                        for chunk in prompts.chunks(ctx.plan.data.val_batch_size)])
    out = out.with_columns(response_text=response_texts(ctx.tokenizer, out))
    statuses: dict[str, int] = {}
    score, _ = _score(ctx, out, statuses=statuses)
    # The validation responses and their scores, readable like the training buffers (not consumed by any
    # stage: a retried validation replaces them).
    write_buffer(ctx.store, ctx.plan.run_id, iteration, "validation", out.with_tensors(score=score))
    metrics = {"val/score/mean": float(score.mean()), "timing_s/validate": time.perf_counter() - start,
               "val/response_length/mean": float(response_lengths(out).float().mean()),
               **status_shares(statuses, len(out), "val")}
    if "tool_calls" in out:
        metrics.update(tool_metrics(out, "val/tools"))
    if "env_errors" in out:
        metrics.update(env_metrics(out, "val/env"))
    for source in sorted(set(out["data_source"])):
        rows = torch.tensor([s == source for s in out["data_source"]])
        metrics[f"val/{source}/score/mean"] = float(score[rows].mean())
    get_run_logger().info("iteration %d: validation score %.3f", iteration, metrics["val/score/mean"])
    return StageResult(metrics=metrics)
