"""Faults on purpose, for tests of retry and recovery: `debug.fail_stage=update_policy debug.fail_times=1`.

Off by default. The count of failures already injected is kept in the run's storage, so a retried or
resumed flow run (a new process) sees how many times the stage has failed before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from engine.config import MAX_ITERATIONS, MAX_RANKS

if TYPE_CHECKING:
    from infra.runs import RunStore
    from infra.store import ObjectStore


class StageContext(Protocol):
    """What the faults read of a stage's context (tasks.context.StageContext, which imports this module)."""

    plan: Any  # tasks.context.RunPlan, whose `debug` is a FaultConfig
    runs: RunStore
    store: ObjectStore


class FaultConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    fail_stage: str | None = Field(None, description="a stage task name that raises (tests only)")
    fail_times: int = Field(1, ge=1, le=100, description="how many attempts of that stage fail")
    fail_iteration: int | None = Field(
        None, ge=1, le=MAX_ITERATIONS, description="only this iteration (default: every one)")
    kill_flow_after: str | None = Field(None, description="SIGKILL the flow process once this stage is done")
    kill_iteration: int = Field(1, ge=1, le=MAX_ITERATIONS, description="the iteration of the kill_* faults")
    kill_rank_mid_update: int | None = Field(
        None, ge=0, lt=MAX_RANKS, description="this policy rank dies mid-update")
    stop_rank_mid_update: int | None = Field(
        None, ge=0, lt=MAX_RANKS, description="this policy rank stops itself (SIGSTOP) mid-update: alive but "
        "hung, its peer blocked in a collective")
    kill_during_checkpoint: bool = Field(False, description="the saving process dies after the shards "
                                         "are written, before the commit")


class InjectedFault(RuntimeError):
    """Raised by a stage that was told to fail (debug.fail_stage)."""


def maybe_fail(ctx: StageContext, stage: str, iteration: int) -> None:
    cfg = ctx.plan.debug
    if cfg.fail_stage != stage or (cfg.fail_iteration is not None and cfg.fail_iteration != iteration):
        return
    key = ctx.runs.key("debug", f"{stage}_{iteration:06d}.failures")
    count = int(ctx.store.get_bytes(key)) if ctx.store.exists(key) else 0
    if count < cfg.fail_times:
        ctx.store.put_bytes(key, str(count + 1).encode())
        raise InjectedFault(f"debug.fail_stage={stage}: failure {count + 1} of {cfg.fail_times} "
                            f"(iteration {iteration})")


def maybe_kill_flow(ctx: StageContext, stage: str, iteration: int) -> None:
    """SIGKILL this (flow) process once, right after `stage` of `kill_iteration` finished: a crash."""
    import os
    import signal

    cfg = ctx.plan.debug
    if cfg.kill_flow_after != stage or cfg.kill_iteration != iteration:
        return
    if _once(ctx, f"killed_after_{stage}", iteration):
        os.kill(os.getpid(), signal.SIGKILL)


def _once(ctx: StageContext, what: str, iteration: int) -> bool:
    """True the first time only, across processes and flow runs (a marker object in the run)."""
    return bool(ctx.store.put_if_absent(ctx.runs.key("debug", f"{what}_{iteration:06d}"), b"1"))


def maybe_kill_rank(ctx: StageContext, engine: Any, role: str, iteration: int) -> None:
    """Arm one policy rank to exit in the middle of this iteration's update (after its first backward)."""
    debug = ctx.plan.debug
    if role != "policy" or debug.kill_iteration != iteration:
        return
    rank = debug.kill_rank_mid_update
    if rank is not None and _once(ctx, f"killed_rank_{rank}", iteration):
        engine.policy.call("debug_fault", "exit_mid_update", rank)
    rank = debug.stop_rank_mid_update
    if rank is not None and _once(ctx, f"stopped_rank_{rank}", iteration):
        engine.policy.call("debug_fault", "stop_mid_update", rank)


def maybe_kill_uploader(ctx: StageContext, iteration: int) -> None:
    """SIGKILL the process saving this checkpoint, once, after the shards are written and before the
    commit: a crash in the middle of a checkpoint upload."""
    import os
    import signal

    if not ctx.plan.debug.kill_during_checkpoint or ctx.plan.debug.kill_iteration != iteration:
        return
    if _once(ctx, "killed_checkpoint", iteration):
        os.kill(os.getpid(), signal.SIGKILL)
