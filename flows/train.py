"""The train flow and the iteration flow: the RL algorithm, read top to bottom.

    train(config_path, overrides, resume)
      open the run (inputs checked first) -> reconcile with storage and the engine -> iterations ->
      validate every val_every -> checkpoint every save_every and at the end -> export

    rl_iteration(plan, k): rollout -> reward | log-probs -> advantages -> critic update -> policy update

Recovery contract (docs/architecture.md): the latest committed checkpoint c, the last finished iteration i
(its metrics written), the engine's version v if alive. Alive with v in {i, i+1}: go on at i+1 (the
update stages know whether their update is applied). Otherwise restart the engine, restore c and replay
the updates c+1..i from the persisted advantage buffers — no regeneration.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from prefect import flow, get_run_logger
from prefect.context import SettingsContext
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY
from prefect_ray.context import remote_options

from engine.advantage import make_kl_controller
from engine.cpu_kernels import kernel_env
from engine.engine import Engine, EngineSpec
from engine.errors import ConfigError, EngineDeadError, EngineHungError, VersionMismatchError
from engine.state.checkpoint_io import CheckpointCorruptError
from flows import pipeline, progress, report, trace
from flows.config import RLConfig
from flows.loggers import MetricLoggers, require_packages, run_log_dir
from flows.plan import OpenRun, open_run, resolve_config
from infra.buffers import load_ref, read_buffer, recorded_metric
from infra.checkpoints import CheckpointStore, Manifest
from infra.config import StorageConfig
from infra.errors import IntegrityError
from tasks.context import RunPlan, context
from tasks.faults import maybe_kill_flow
from tasks.runner import StageTaskRunner
from tasks.stages import StageResult, episodes_table, save_checkpoint, task_for, validate, with_retries

log = logging.getLogger("rlflow.train")

# Stage tasks hold almost no CPU (the actors do the work): num_cpus=0, and a custom resource caps
# how many run at once. Without it they wait forever behind the actors that hold the cores.
STAGE_RESOURCE = "rlflow_stage"
# Engine compute on the critical path of one iteration (what perf/orchestration_s subtracts).
_COMPUTE = ("timing_s/gen", "timing_s/gen_baseline", "timing_s/old_log_prob", "timing_s/ref", "timing_s/values",
            "timing_s/adv", "timing_s/update_critic", "timing_s/update_actor", "timing_s/weight_sync")


def stage_options() -> Any:
    return remote_options(num_cpus=0, resources={STAGE_RESOURCE: 1})


@flow(name="rl-iteration", flow_run_name="iter-{iteration:06d}", persist_result=True, task_runner=StageTaskRunner())
def rl_iteration(plan: RunPlan, iteration: int, kl_coef: float) -> dict[str, float]:
    """One RL iteration: the declared stages (flows/algorithms.py), each a task on Ray whose inputs are
    the stages that wrote what it reads; returns the iteration's metrics. Under the asynchronous
    schedule (flows/pipeline.py) it waits before its first training stage and before its weight sync,
    and a prefetch (an iteration past the flow run's last) ends before its training stages."""
    start = time.perf_counter()
    schedule = pipeline.schedule_of(plan.run_id)
    futures: dict[str, Any] = {}
    training = prefetch = False
    with stage_options():
        for stage in plan.stages:
            if schedule is not None:
                if stage.engine and stage.task not in ROLLOUT_TASKS and not training:
                    training = True
                    if not schedule.before_training(iteration):
                        prefetch = True
                        break
                if stage.task == "sync_weights":
                    schedule.before_sync(iteration)
                if stage.task == "continue_rollouts":
                    schedule.before_continue(iteration)
            inputs = {source: futures[source] for source in stage.inputs}
            futures[stage.name] = task_for(stage, plan).submit(plan, iteration, stage, inputs, kl_coef,
                                                         wait_for=[futures[a] for a in stage.after])
            if schedule is not None and stage.task in _NOTED:
                _on_end(schedule, iteration, futures[stage.name], stage.task)
            if plan.debug.kill_flow_after == stage.name:
                futures[stage.name].result()
                maybe_kill_flow(context(plan), stage.name, iteration)
        results = {name: f.result() for name, f in futures.items()}
    # A stage is reused when Prefect returned its cached result, or it found its complete buffer.
    reused = sorted(n for n, f in futures.items() if f.state.name == "Cached" or results[n].reused)
    spans = trace.spans_of(plan.run_id)
    for name, result in results.items():
        if name not in reused and result.span is not None:
            spans.add(iteration, name, *result.span)
    if reused:
        get_run_logger().info("iteration %d: reused %s (no regeneration)", iteration, ", ".join(reused))
    if plan.rollout.episodes is not None and (ref := results["generate_rollouts"].ref) is not None:
        # the episodes' table on this iteration's flow run, made here so that a rollout reused from an
        # earlier attempt (Retry: its task comes back Cached and runs nothing) shows it too
        episodes_table(plan.run_id, iteration, read_buffer(context(plan).store, ref))
    if prefetch:
        get_run_logger().info("iteration %d: rollout prefetched for the next flow run (stages %s)", iteration,
                              ", ".join(futures))
        return {PREFETCH: 1.0}
    metrics: dict[str, float] = {}
    for result in results.values():
        metrics.update(result.metrics)
    step_s = time.perf_counter() - start
    metrics["timing_s/step"] = step_s
    if schedule is None:  # under the asynchronous schedule a step overlaps others: see run_iteration
        compute = sum(metrics.get(k, 0.0) for k in _COMPUTE) if not reused else step_s
        metrics["perf/orchestration_s"] = max(0.0, step_s - compute)
        metrics["perf/time_per_step"] = step_s
        metrics["perf/throughput"] = metrics.get("perf/total_num_tokens", 0.0) / step_s
    metrics["stages/reused"] = float(len(reused))
    report.iteration_table(plan.run_id, iteration, {**metrics, "actor/kl_coef": kl_coef})
    return metrics


# the stages that use the rollout pool
ROLLOUT_TASKS = ("generate_rollouts", "continue_rollouts", "generate_baseline")
PREFETCH = "stages/prefetch_only"
# the stages whose end the asynchronous schedule waits for: the rollout (its first part with partial
# rollouts), the rest of a partial rollout, a weight sync
_NOTED = {"generate_rollouts": "the rollout", "continue_rollouts": "the continued rollout",
          "sync_weights": "the weight sync"}


def _on_end(schedule: pipeline.Schedule, iteration: int, future: Any, task: str) -> None:
    """Tell the schedule when stage `task` of `iteration` has ended: done, or failed (which aborts the
    schedule: a weight sync waiting for this rollout, or a rollout waiting for this sync, must not wait
    forever)."""
    def watch() -> None:
        future.wait()
        if future.state.is_completed():
            schedule.ended(task, iteration)
        else:
            schedule.fail(iteration, RuntimeError(f"{_NOTED[task]} of iteration {iteration} failed: "
                                                  f"{future.state.message}"))

    threading.Thread(target=watch, name=f"rlflow-{task}-{iteration}", daemon=True).start()


@dataclass
class Trainer:
    """What the train flow keeps between iterations."""

    run: OpenRun
    kl: Any
    loggers: Any
    history: list[dict[str, Any]] = field(default_factory=list)
    stop_requested: bool = False
    last_commit: float | None = None  # perf_counter of the last iteration's commit (asynchronous steps)
    recoveries: dict[int, dict[str, float]] = field(default_factory=dict)  # engine restarts, per iteration
    _subflow_settings: tuple[Any, Any] | None = None  # (the run's settings, the subflows' copy)

    def subflow_settings(self) -> SettingsContext:
        """The settings the iteration subflows run with: the run's, without a heartbeat. Built once (a
        settings copy costs ~0.1 s of validation) and again only if the run's settings change."""
        current = SettingsContext.get()
        assert current is not None
        if self._subflow_settings is None or self._subflow_settings[0] is not current.settings:
            updated = current.settings.copy_with_update(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
            self._subflow_settings = (current.settings, updated)
        return SettingsContext(profile=current.profile, settings=self._subflow_settings[1])

    @property
    def plan(self) -> RunPlan:
        return self.run.plan

    @property
    def cfg(self) -> RLConfig:
        return self.run.cfg

    def trainer_state(self, iteration: int) -> dict[str, Any]:
        """trainer.json, what a resume reads from the checkpoint (_restore_kl): the KL controller after
        `iteration`. The sampler's step under dynamic sampling and safe RL's multiplier are each in the
        iteration's own committed buffer, where every iteration (resumed or not) reads them."""
        return {"iteration": iteration, "kl_ctrl": self.kl.state_dict()}


@flow(name="rlflow-train", flow_run_name="{run_name}", persist_result=True, task_runner=StageTaskRunner())
def train(config_path: str | None = None, overrides: list[str] | None = None, resume: str | None = None,
          run_name: str = "train", parent: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train (or resume) one run; returns a summary. Parameters are JSON-able and hold no credentials.
    `parent`: the lineage a new run records in run.json (the run and checkpoint it starts from)."""
    logger = get_run_logger()
    cfg, run_id = resolve_config(config_path, list(overrides or []), resume)
    require_packages(cfg.trainer.loggers)  # a missing logger package fails before anything starts
    check_storage_reaches_nodes(cfg.storage, ray.nodes())
    run = open_run(cfg, run_id, resume=resume is not None, parent=parent)
    if resume is not None:  # this process holds the run's lease: an earlier "Running" run of it is dead
        _crash_orphans(run_id)
    log_dir = run_log_dir(cfg.trainer.log_dir, storage_root=cfg.storage.root, run_id=run_id)
    loggers = MetricLoggers.create(cfg.trainer.loggers, run_id=run_id, log_dir=str(log_dir), config=cfg.public_dict(),
                                   project=cfg.trainer.project)
    trainer = Trainer(run, make_kl_controller(cfg.algorithm), loggers)
    try:
        engine, first = reconcile(trainer)
        last = _last_iteration(cfg, first)
        logger.info("run %s: iterations %d..%d (engine version %d)", run_id, first, last, first - 1)
        if first == 1 and cfg.trainer.val_every and not run.runs.finished_iterations():
            _validate_before(trainer)
        progress = report.Progress(run_id, first, last)

        def committed(iteration: int) -> None:
            try:
                progress.update(iteration)
            except Exception as err:  # the artifact is a UI nicety: an API restart must not end the run
                if not _api_unreachable(err):
                    raise
                log.warning("iteration %d: progress artifact not updated (Prefect API unreachable)", iteration)

        with _graceful_stop(trainer):
            if cfg.trainer.max_staleness:
                engine = run_async(trainer, engine, last, committed)
            else:
                for iteration in range(first, last + 1):
                    engine = run_with_restarts(trainer, engine, iteration)
                    committed(iteration)
                    if trainer.stop_requested:
                        logger.warning("stop requested: committing iteration %d and stopping", iteration)
                        break
        finished = run.runs.last_finished_iteration() or 0
        _checkpoint(trainer, finished, force=True)
        export = _export(trainer, engine, finished) if cfg.trainer.export_at_end and not trainer.stop_requested else None
        checkpoints = [(s, run.store.url(f"{run_id}/checkpoints/step_{s:06d}"))
                       for s in trainer_checkpoints(trainer)]
        timeline = _write_timeline(trainer, engine)
        report.publish_summary(run_id, report.summary(run_id, run.runs.read_metrics(), checkpoints, export, timeline),
                               checkpoints, timeline)
        if not cfg.trainer.keep_engine:
            engine.stop()
        return {"run_id": run_id, "finished_iteration": finished, "export": export,
                "storage": run.store.url(run_id), "stopped_early": trainer.stop_requested}
    finally:
        loggers.close()
        run.lease.release()


def run_async(trainer: Trainer, engine: Engine, last: int, committed: Any) -> Engine:
    """Iterations up to `last` under the asynchronous schedule (flows/pipeline.py). When one fails on the
    engine (a dead rank, a wrong version), the others are aborted, the engine is restarted, restored and
    replayed, and the schedule runs again from the last committed iteration, reusing finished stages."""
    cfg = trainer.cfg
    restarts = api_outages = 0
    while True:
        first = (trainer.run.runs.last_finished_iteration() or 0) + 1
        schedule = pipeline.Schedule(trainer.plan.run_id, cfg.trainer.max_staleness, first, last,
                                     cfg.trainer.total_iterations, partial=cfg.rollout.partial_tokens is not None)

        def failed(err: BaseException, live: Engine = engine) -> None:
            if isinstance(err, (EngineDeadError, VersionMismatchError)):
                live.stop()  # frees the iterations blocked on it (a sync waiting for a dead peer)

        try:
            pipeline.run_schedule(schedule, lambda i: run_iteration(trainer, i), committed,
                                  lambda: trainer.stop_requested, failed)
            return engine
        except (EngineDeadError, VersionMismatchError) as err:
            if restarts == cfg.trainer.max_engine_restarts:
                raise
            restarts += 1
            get_run_logger().warning("iteration %d: the engine failed (%s); restart %d of %d", first,
                                     str(err).splitlines()[0], restarts, cfg.trainer.max_engine_restarts)
            began = time.perf_counter()
            engine.stop()
            engine, _ = reconcile(trainer, restart=True)
            _count_recovery(trainer, first, err, time.perf_counter() - began)
        except Exception as err:
            if not _api_unreachable(err) or api_outages == _API_OUTAGES:
                raise
            api_outages += 1
            log.warning("the Prefect API is unreachable (%s); waiting for it, then running the schedule again",
                        type(err).__name__)
            _wait_for_api(_API_WAIT_S)


def _write_timeline(trainer: Trainer, engine: Engine) -> str | None:
    """trace/timeline.json with this flow run's stage spans and the ranks' calls; None if it failed (the
    timeline is for people: it never fails a run)."""
    try:
        return trace.write_timeline(trainer.run.store, trainer.plan.run_id, trace.spans_of(trainer.plan.run_id),
                                    engine.drain_spans())
    except Exception as err:  # noqa: BLE001
        log.warning("the run's timeline was not written: %s", err)
        return None


def run_with_restarts(trainer: Trainer, engine: Engine, iteration: int) -> Engine:
    """Run iteration k; when an engine rank died (or the engine is at the wrong version), restart it,
    restore and replay per the recovery contract, and run k again: its finished stages are reused."""
    restarts = trainer.cfg.trainer.max_engine_restarts
    attempt = api_outages = 0
    while True:
        try:
            run_iteration(trainer, iteration)
            return engine
        except (EngineDeadError, VersionMismatchError) as err:
            if attempt == restarts:
                raise
            attempt += 1
            get_run_logger().warning("iteration %d: the engine failed (%s); restart %d of %d",
                                     iteration, str(err).splitlines()[0], attempt, restarts)
            began = time.perf_counter()
            engine.stop()
            engine, _ = reconcile(trainer, restart=True)
            _count_recovery(trainer, iteration, err, time.perf_counter() - began)
        except Exception as err:
            # The Prefect API went away (a server restart) while the iteration created a flow or task
            # run: wait for it, then run the iteration again; its finished stages are reused from storage
            # and an update the engine already has is not applied twice.
            if not _api_unreachable(err) or api_outages == _API_OUTAGES:
                raise
            api_outages += 1
            log.warning("iteration %d: the Prefect API is unreachable (%s); waiting for it, then running "
                        "the iteration again", iteration, type(err).__name__)
            _wait_for_api(_API_WAIT_S)


def _crash_orphans(run_id: str) -> None:
    """Mark Crashed the flow runs of `run_id` that a dead controller left "Running" (it was SIGKILLed,
    or exited on a lost Ray head without reporting), and their iteration subflows, naming this run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterParentFlowRunId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.context import FlowRunContext
    from prefect.states import Crashed

    this = FlowRunContext.get()
    if this is None or this.flow_run is None:
        return
    running = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))
    message = f"its process died; run {run_id} was resumed by flow run {this.flow_run.name} ({this.flow_run.id})"
    try:
        with get_client(sync_client=True) as client:
            orphans = [r for r in client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["rlflow-train"])),
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_id]), state=running))
                if r.id != this.flow_run.id]  # fmt: skip
            for orphan in orphans:
                for child in client.read_flow_runs(flow_run_filter=FlowRunFilter(
                        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[orphan.id]), state=running)):
                    client.set_flow_run_state(child.id, Crashed(message=message), force=True)
                client.set_flow_run_state(orphan.id, Crashed(message=message), force=True)
                get_run_logger().warning("flow run %s (%s) of run %s was left Running by a dead process: marked "
                                         "Crashed", orphan.name, orphan.id, run_id)
    except Exception as err:  # the UI's states are a nicety: a failure here must not stop the resume
        log.warning("could not mark the earlier flow runs of %s Crashed: %s", run_id, err)


def _count_recovery(trainer: Trainer, iteration: int, err: BaseException, seconds: float) -> None:
    """engine/restarts (and engine/hung_restarts, engine/restart_s) in the metrics of the iteration."""
    line = trainer.recoveries.setdefault(iteration, {"engine/restarts": 0.0, "engine/hung_restarts": 0.0,
                                                     "engine/restart_s": 0.0})  # fmt: skip
    line["engine/restarts"] += 1
    line["engine/hung_restarts"] += isinstance(err, EngineHungError)
    line["engine/restart_s"] += seconds


_API_OUTAGES = 3  # per iteration
_API_WAIT_S = 300.0


def _api_unreachable(err: BaseException) -> bool:
    """Whether `err` (or what caused it) is a failed connection to the Prefect API."""
    import httpx

    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (httpx.TransportError, ConnectionError)):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _wait_for_api(timeout_s: float) -> None:
    import httpx
    from prefect.settings import PREFECT_API_URL

    url = f"{PREFECT_API_URL.value()}/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the Prefect API at {url} did not come back within {timeout_s:.0f} s")


def run_iteration(trainer: Trainer, iteration: int) -> dict[str, float] | None:
    """Iteration k, then its validation, then its metrics line (the commit), then its checkpoint. None
    when the asynchronous schedule ran it as a prefetch (its rollout only)."""
    cfg, plan = trainer.cfg, trainer.plan
    started = time.perf_counter()
    # No heartbeat thread for the per-iteration subflow (the run's flow keeps its own): Prefect joins it at
    # the subflow's end, and it sleeps in 1 s steps, so every iteration waited ~0.5 s for it.
    with trainer.subflow_settings():
        metrics = rl_iteration(plan, iteration, trainer.kl.value)
    if metrics.get(PREFETCH):
        return None
    metrics["actor/kl_coef"] = trainer.kl.value
    if "actor/reward_kl_penalty" in metrics:
        trainer.kl.update(metrics["actor/reward_kl_penalty"], n_steps=cfg.data.train_batch_size * cfg.rollout.n)
    if cfg.trainer.val_every and iteration % cfg.trainer.val_every == 0:
        with stage_options():
            result = with_retries(validate, plan).submit(plan, iteration).result()
        metrics.update(result.metrics)
        if result.span is not None:
            trace.spans_of(plan.run_id).add(iteration, "validate", *result.span)
    # The whole iteration as the user waits for it: the subflow, its stages, validation (timing_s/step
    # is the subflow's own stages only).
    now = time.perf_counter()
    metrics["timing_s/iteration"] = now - started
    if cfg.trainer.max_staleness:  # iterations overlap: a step is the time between two commits
        if trainer.last_commit is not None:
            metrics["perf/time_per_step"] = now - trainer.last_commit
            metrics["perf/throughput"] = metrics.get("perf/total_num_tokens", 0.0) / metrics["perf/time_per_step"]
        trainer.last_commit = now
    metrics.update(trainer.recoveries.pop(iteration, {}))
    trainer.run.runs.write_metrics(iteration, metrics)
    trainer.loggers.log(iteration, metrics)
    progress.notify(iteration, metrics)
    get_run_logger().info(  # the console shows progress.summary_line instead
        "iter %d: reward %.3f%s  length %.1f  step %.1f s  (orchestration %.2f s)", iteration,
        metrics.get("critic/score/mean", float("nan")),
        f"  val {metrics['val/score/mean']:.3f}" if "val/score/mean" in metrics else "",
        metrics.get("response_length/mean", float("nan")), metrics["timing_s/step"],
        metrics.get("perf/orchestration_s", float("nan")),
        extra={"console": False})
    if iteration % cfg.trainer.save_every == 0:
        _checkpoint(trainer, iteration)
    return metrics


def reconcile(trainer: Trainer, restart: bool = False) -> tuple[Engine, int]:
    """(engine at the right version, next iteration), per the recovery contract. `restart`: after the
    engine failed, when its ranks may have to wait for the cluster to have room again (a lost node)."""
    logger = get_run_logger()
    run, plan = trainer.run, trainer.plan
    finished = run.runs.last_finished_iteration() or 0
    _restore_kl(trainer)
    try:
        engine = Engine.attach(plan.engine)
        versions = engine.versions()
        if all(v in (finished, finished + 1) for v in versions.values()):
            logger.info("attached to the live engine of %s at versions %s", plan.run_id, versions)
            return engine, finished + 1
        logger.warning("the live engine is at versions %s, storage at iteration %d: restarting it",
                       versions, finished)
        engine.stop()
    except EngineDeadError as err:
        logger.info("no live engine (%s): starting one", err)
    Engine.stop_run(plan.run_id, plan.engine.namespace)
    start = time.perf_counter()
    logger.info("starting the engine: %s (loading the models on every rank)", _engine_shape(plan.engine))
    engine = Engine.start(plan.engine, waiting=logger.warning, restart=restart)
    logger.info("engine started in %.1f s", time.perf_counter() - start)
    step = None
    if finished:
        start = time.perf_counter()
        logger.info("restoring the newest checkpoint (storage has iteration %d)", finished)
        step = restore(engine, _checkpoint_store(trainer), run.store.storage_options())
        logger.info("restored checkpoint step %s in %.1f s", step, time.perf_counter() - start)
    for iteration in range(1 + (step or 0), finished + 1):
        replay(trainer, iteration)
    if engine.rollout is not None:  # the rollout pool gets the weights of the last committed iteration
        engine.sync_weights(finished)
    return engine, finished + 1


def _engine_shape(spec: EngineSpec) -> str:
    """"policy 2 ranks, critic 2 ranks": the pools an engine start places."""
    return ", ".join(f"{pool} {ranks} rank{'s' if ranks > 1 else ''}" for pool, ranks, _, _ in spec.pools())


def restore(engine: Engine, ckpts: CheckpointStore, storage_options: dict[str, Any]) -> int | None:
    """Load the newest committed checkpoint into the engine, each file verified against the manifest as
    the ranks read it (one read of every byte); a corrupt one falls back to the one before."""
    def load(step: int, manifest: Manifest) -> None:
        expected = {f.path: (f.size, f.sha256) for f in manifest.files}
        try:
            engine.load(ckpts.step_url(step), storage_options, expected)
        except CheckpointCorruptError as err:
            raise IntegrityError(str(err)) from None

    return ckpts.restore(load)


def replay(trainer: Trainer, iteration: int) -> None:
    """Re-apply iteration k's updates from its persisted advantage buffer (no regeneration)."""
    plan = trainer.plan
    ref = load_ref(trainer.run.store, plan.run_id, iteration, "advantage")
    if ref is None:
        raise EngineDeadError(f"cannot replay iteration {iteration} of {plan.run_id}: its advantage buffer is "
                              "missing and no later checkpoint exists")
    get_run_logger().info("replaying the updates of iteration %d from %s", iteration, ref.uri)
    inputs = {"compute_advantages": StageResult(ref=ref)}
    with stage_options():
        for stage in plan.stages:
            if stage.task in ("update_critic", "update_policy"):  # they read the advantage buffer alone
                assert set(stage.inputs) == {"compute_advantages"}, stage.sources
                task_for(stage, plan).submit(plan, iteration, stage, inputs, 0.0).result()


def trainer_checkpoints(trainer: Trainer) -> list[int]:
    return _checkpoint_store(trainer).committed_steps()


def _checkpoint_store(trainer: Trainer) -> CheckpointStore:
    storage = trainer.cfg.storage
    return trainer.run.runs.checkpoints(storage.keep_last, storage.keep_every)


def _checkpoint(trainer: Trainer, iteration: int, force: bool = False) -> None:
    if iteration <= 0 or (not force and iteration % trainer.cfg.trainer.save_every):
        return
    with stage_options():
        task = with_retries(save_checkpoint, trainer.plan)
        saved = task.submit(trainer.plan, iteration, trainer.trainer_state(iteration)).result()
    if saved.span is not None:
        trace.spans_of(trainer.plan.run_id).add(iteration, "save_checkpoint", *saved.span)
    if not saved.reused:  # after the iteration's metrics (its end): the save is in the log
        get_run_logger().info("checkpoint step %d committed: %.2f MB in %.2f s", iteration,
                              saved.metrics["checkpoint/mb"], saved.metrics["timing_s/save_checkpoint"])


def _validate_before(trainer: Trainer) -> None:
    """Validation of the initial policy: iteration 0's metrics line (the 'before' of a run)."""
    with stage_options():
        metrics = with_retries(validate, trainer.plan).submit(trainer.plan, 0).result().metrics
    if metrics:
        trainer.run.runs.write_metrics(0, metrics)
        name, key = next((n, k) for n, k in (("loss", "val/loss"), ("preference accuracy", "val/preference_accuracy"),
                                             ("score", "val/score/mean")) if k in metrics)
        get_run_logger().info("iter 0: validation %s %.3f before training", name, metrics[key])


def _export(trainer: Trainer, engine: Engine, iteration: int) -> str:
    """The policy in Hugging Face format under export/step_N; a LoRA run writes peft's adapter folder
    there and, with trainer.export_merged, the merged weights under export/step_N_merged."""
    url = trainer.run.store.url(f"{trainer.plan.run_id}/export/step_{iteration:06d}")
    merged = url + "_merged" if trainer.cfg.trainer.export_merged else None
    engine.export_hf(url, trainer.run.store.storage_options(), merged)
    if trainer.cfg.actor.lora.enabled:
        get_run_logger().info("exported the LoRA adapters (peft) to %s%s", url,
                              f" and the merged weights to {merged}" if merged else "")
    else:
        get_run_logger().info("exported Hugging Face weights to %s", url)
    return url


def _restore_kl(trainer: Trainer) -> None:
    """The KL controller after the last finished iteration, from committed records only: the state the
    newest checkpoint at or before it committed (its trainer.json), then each later iteration's update
    from the KL its advantage buffer recorded. Never the metrics files, which a user may edit. A fixed
    controller has no state."""
    cfg = trainer.cfg
    trainer.kl = make_kl_controller(cfg.algorithm)
    if cfg.algorithm.kl_ctrl != "adaptive":
        return
    finished = trainer.run.runs.last_finished_iteration() or 0
    ckpts = _checkpoint_store(trainer)
    start = 0
    for step in sorted((s for s in ckpts.committed_steps() if s <= finished), reverse=True):
        state = _kl_state(ckpts, step)
        if state is not None:
            trainer.kl.load_state_dict(state)
            start = step
            break
    store, run_id = trainer.run.store, trainer.plan.run_id
    for iteration in range(start + 1, finished + 1):
        ref = load_ref(store, run_id, iteration, "advantage")
        if ref is None:
            raise RuntimeError(f"the adaptive KL controller after iteration {iteration} is recorded in that "
                               "iteration's advantage buffer, and it is not in storage")
        kl = recorded_metric(store, ref, "actor/reward_kl_penalty",
                             f"the adaptive KL controller after iteration {iteration} cannot be restored")
        trainer.kl.update(kl, n_steps=cfg.data.train_batch_size * cfg.rollout.n)


def _kl_state(ckpts: CheckpointStore, step: int) -> dict[str, float] | None:
    """The KL controller's state in step's trainer.json (verified against the manifest, parsed totally); None,
    with a warning, when it is missing, does not verify or holds no controller: an older one is used."""
    try:
        state = ckpts.read_trainer_state(step)
    except IntegrityError as err:
        log.warning("checkpoint step %d: %s; the KL controller comes from an older record", step, err)
        return None
    kl = (state or {}).get("kl_ctrl")
    if state is not None and not (isinstance(kl, dict) and "value" in kl):
        log.warning("checkpoint step %d: trainer.json holds no KL controller; an older record is used", step)
        return None
    return kl


def _last_iteration(cfg: RLConfig, first: int) -> int:
    last = cfg.trainer.total_iterations
    if cfg.trainer.iterations_per_run:
        last = min(last, first + cfg.trainer.iterations_per_run - 1)
    return last


def check_storage_reaches_nodes(storage: StorageConfig, nodes: list[dict[str, Any]]) -> None:
    """A local storage root is this machine's folder: the stage tasks and ranks on other nodes would write
    buffers and checkpoints that this machine never sees. ConfigError before anything is written,
    unless the user says every node mounts it (storage.shared_fs)."""
    alive = [n for n in nodes if n.get("Alive")]
    if "://" in storage.root and not storage.root.startswith("file://") or storage.shared_fs or len(alive) < 2:
        return
    raise ConfigError(f"storage.root={storage.root} is a local folder and the Ray cluster has {len(alive)} nodes: "
                      "use an object store (s3://bucket/prefix), or set storage.shared_fs=true if every node "
                      "mounts that folder")


def connect_ray(address: str, cfg: RLConfig) -> None:
    """Join the Ray cluster that outlives the flow as a driver, before the flow starts: a RayTaskRunner
    that finds Ray initialised uses it and leaves it running (one that starts Ray kills it at flow end,
    and the detached engine with it)."""
    global _connected
    wanted = (address, cfg.ray.namespace, worker_env(cfg))
    if ray.is_initialized():
        if _connected is None or _connected == wanted:
            return  # Ray set up by whoever called (used as it is), or this run's own connection again
        # A later run in this process (a notebook, tests/warm_cli.py) with another cluster, namespace or
        # worker environment (storage credentials): the job's stage workers must not keep the old one.
        ray.shutdown()
    ray.init(address=address, namespace=cfg.ray.namespace, log_to_driver=False, logging_level="WARNING",
             runtime_env={"env_vars": wanted[2]})
    _connected = wanted


_connected: tuple[str, str, dict[str, str]] | None = None  # what connect_ray joined with, in this process


# What the Ray workers running stages need from this process's environment. Credentials are NOT
# among them: Ray writes a job's runtime environment into its logs (runtime_env_agent.log), so the
# workers get the path of a 0600 credentials file instead (see `credentials_file`).
_WORKER_ENV = ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_LOGGING_LEVEL", "PREFECT_LOCAL_STORAGE_PATH",
               "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION", "RLFLOW_CACHE",
               "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "DO_NOT_TRACK")


def worker_env(cfg: RLConfig) -> dict[str, str]:
    env = {key: os.environ[key] for key in _WORKER_ENV if key in os.environ}
    # The same CPU kernels on every machine: the run's bytes do not depend on where it runs.
    env.update(kernel_env(cfg.placement.cpu_kernels))
    key_id = cfg.storage.access_key_id.get_secret_value() if cfg.storage.access_key_id else \
        os.environ.get("AWS_ACCESS_KEY_ID")
    secret = cfg.storage.secret_access_key.get_secret_value() if cfg.storage.secret_access_key else \
        os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key_id and secret:
        env["AWS_SHARED_CREDENTIALS_FILE"] = str(credentials_file(key_id, secret,
                                                                  os.environ.get("AWS_SESSION_TOKEN")))
        env["AWS_PROFILE"] = CREDENTIALS_PROFILE
    return env


CREDENTIALS_PROFILE = "rlflow"


def credentials_file(key_id: str, secret: str, token: str | None) -> Path:
    """An AWS shared-credentials file readable by this user only, in the stack's state folder; its
    name is a hash and this process's id, so the workers' environment (which Ray logs) holds no
    credential. Removed when this process exits (its Ray job's workers end with it), and by `rlflow down`
    (a process that was killed)."""
    from infra.stack import private_state_dir, private_temp_dir, resolve_home

    folder = private_temp_dir(private_state_dir(resolve_home()) / "credentials", "the credentials folder")
    body = f"[{CREDENTIALS_PROFILE}]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n"
    if token:
        body += f"aws_session_token = {token}\n"
    path = folder / f"{hashlib.sha256(body.encode()).hexdigest()[:16]}-{os.getpid()}.ini"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(body)
        os.replace(tmp, path)
    if path not in _REMOVED_AT_EXIT:
        _REMOVED_AT_EXIT.add(path)
        atexit.register(path.unlink, missing_ok=True)
    return path


_REMOVED_AT_EXIT: set[Path] = set()


class _graceful_stop:
    """First Ctrl-C: finish (and commit) the current iteration, then stop. Second: stop now."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def __enter__(self) -> None:
        try:
            self.previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self.previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.trainer.stop_requested:
            raise KeyboardInterrupt
        self.trainer.stop_requested = True
        print("\nrlflow: stopping after this iteration is committed (Ctrl-C again to stop now)", flush=True)

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


