"""Recurring runs: the train flow as a Prefect deployment, served by `rlflow serve`.

    rlflow deploy configs/tiny_grpo.yaml trainer.iterations_per_run=5 --cron "0 2 * * *" --name nightly
    rlflow serve                 # long-running: executes the scheduled, manual and retried runs

One deployment is one lineage. Its flow runs never overlap: the deployment's concurrency limit is 1, and
a run that comes due while another runs waits for it (`--collision enqueue`, the default) or is
cancelled (`cancel-new`). Each flow run of `scheduled_train`:

- mode `continue`: the lineage is one run id, the deployment's name. The first flow run creates the run;
  every later one resumes it (latest committed checkpoint, or the live engine) for
  `trainer.iterations_per_run` more iterations on the sampler's next prompts.
- mode `fresh`: a new run id per flow run, `<name>-<date>-<flow run id>`, starting from the weights of
  the base checkpoint (`--base-checkpoint RUN[:STEP]` or the step folder's URL) when one is given.
- mode `chain` (`rlflow deploy SFT_CONFIG --then RL_CONFIG`): each flow run is a night of a post-training
  pipeline: an SFT run on the data as it is now, from the lineage's last RL checkpoint, then an RL run from
  the SFT run's checkpoint (`chained`).

run.json records the lineage: `parent` (run id, step, checkpoint URL, the model folder made from it),
`config_hash` and `code_version`; `rlflow runs show` prints them.

Served rather than a work pool and worker: the runs execute as subprocesses of `rlflow serve`, from the
installed code and with that process's environment. The stack's address and the storage credentials
come from there, never through the deployment (no parameters, no job variables), and there is no pool,
worker or code storage (`flow.from_source`) to run beside it. Retry works the same either way: the
UI's Retry button puts the flow run in `AwaitingRetry`, a scheduled state that whatever polls the
deployment picks up. Scale-out keeps this flow and adds `to_deployment(work_pool_name=...)`.

`scheduled_train` calls `train` as a subflow rather than being deployed itself: create-or-resume is
decided from storage when the run starts, and when a failed run is retried Prefect gives the failed
`train` subflow a new flow run (prefect.flow_engine `load_subflow_run`), whose calls start afresh.
Retrying a `train` flow run in place would pair its `rl_iteration` calls with the failed attempt's by
call order (Prefect's dynamic keys) while it starts at a later iteration. In the new `train` run every
stage whose result exists comes back `Cached` (tasks/stages.py cache keys), and the engine goes on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.context import FlowRunContext
from prefect.types.entrypoint import EntrypointType

from engine.errors import ConfigError
from flows.config import RLConfig, build_config, load_config
from flows.train import connect_ray, train
from infra.checkpoints import CheckpointStore
from infra.runs import RunStore
from infra.store import ObjectStore

FLOW_NAME = "rlflow-scheduled"
Mode = Literal["continue", "fresh", "chain"]
Collision = Literal["enqueue", "cancel-new"]
_STRATEGY = {"enqueue": ConcurrencyLimitStrategy.ENQUEUE, "cancel-new": ConcurrencyLimitStrategy.CANCEL_NEW}
# Overrides that carry credentials: never deployment parameters (the serving process's AWS_* give them).
SECRET_KEYS = ("storage.access_key_id", "storage.secret_access_key")


@dataclass(frozen=True)
class DeploySpec:
    """What `rlflow deploy` was asked for."""

    name: str
    config_path: str | None
    overrides: list[str]
    mode: Mode = "continue"
    base_checkpoint: str | None = None
    cron: str | None = None
    interval_s: float | None = None
    timezone: str | None = None
    collision: Collision = "enqueue"
    pool: str | None = None  # a Prefect work pool (process type) whose workers execute the runs; None: rlflow serve
    then_config_path: str | None = None  # mode chain: the RL run's config, after the SFT run of config_path
    then_overrides: list[str] | None = None

    def parameters(self) -> dict[str, Any]:
        out = {"config_path": self.config_path, "overrides": self.overrides, "mode": self.mode, "lineage": self.name,
               "base_checkpoint": self.base_checkpoint}
        if self.mode == "chain":
            out.update(then_config_path=self.then_config_path, then_overrides=list(self.then_overrides or []))
        return out


@dataclass(frozen=True)
class BaseCheckpoint:
    """A committed checkpoint a new run starts from."""

    run_id: str
    step: int
    url: str


# -- the flow a deployment runs ----------------------------------------------------------------------

def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    when = flow_run.scheduled_start_time
    return f"{flow_run.parameters.get('lineage', 'rlflow')}-{when:%Y%m%d-%H%M%S}"


@flow(name=FLOW_NAME, flow_run_name=_flow_run_name)
def scheduled_train(config_path: str | None = None, overrides: list[str] | None = None, mode: Mode = "continue",
                    lineage: str = "rlflow", base_checkpoint: str | None = None, then_config_path: str | None = None,
                    then_overrides: list[str] | None = None) -> dict[str, Any]:
    """One scheduled run of a lineage: continue its run, start a new run from the base checkpoint, or (mode
    chain) an SFT run then an RL run from it (`chained`)."""
    overrides = list(overrides or [])
    if mode == "chain":
        return chained(config_path, overrides, then_config_path, list(then_overrides or []), lineage)
    cfg = load_config(config_path, overrides)
    run_id = lineage if mode == "continue" else fresh_run_id(lineage)
    base, store = resolve_base(base_checkpoint, cfg) if base_checkpoint else (None, None)
    finished = ("nothing to do (raise trainer.total_iterations or pause the deployment)" if mode == "continue"
                else None)  # mode fresh: a finished run of this flow run resumes (and finds nothing left)
    return _fresh_or_resumed(config_path, overrides, run_id, cfg, base, store, finished)


def chained(sft_config: str | None, sft_overrides: list[str], rl_config: str | None, rl_overrides: list[str],
            lineage: str) -> dict[str, Any]:
    """Mode chain, one night of a lineage: an SFT run (sft_config, on its data files as they are now) from
    the latest checkpoint of the lineage's last RL run (the config's model the first night), then an RL run
    (rl_config) from the SFT run's latest checkpoint. Each is a `train` subflow run of its own, named by
    its run id `<lineage>-<date>-<flow run id>-sft` / `-rl` (the same when this flow run is retried: a
    finished one is not run again, a failed one resumes); each run.json's `parent` names the checkpoint it
    started from, so the lineage reads SFT -> RL -> the next night's SFT -> ..."""
    logger = get_run_logger()
    stamp = fresh_run_id(lineage)
    sft_cfg, rl_cfg = load_config(sft_config, sft_overrides), load_config(rl_config, rl_overrides)
    store = ObjectStore.from_config(sft_cfg.storage)
    previous = last_of_chain(store, lineage, before=f"{stamp}-rl")
    logger.info("night %s: SFT from %s", stamp, f"{previous.run_id} step {previous.step}" if previous else "the config's model")
    again = "not run again (this night retried)"
    sft = _fresh_or_resumed(sft_config, sft_overrides, f"{stamp}-sft", sft_cfg, previous, store, again)
    base, _ = resolve_base(f"{stamp}-sft", sft_cfg)
    rl = _fresh_or_resumed(rl_config, rl_overrides, f"{stamp}-rl", rl_cfg, base, store, again)
    return {"sft": sft, "rl": rl}


_CHAIN_RL = re.compile(r"^(?P<lineage>.+)-\d{8}-\d{6}-[0-9a-f]{8}-rl$")


def last_of_chain(store: ObjectStore, lineage: str, before: str) -> BaseCheckpoint | None:
    """The latest committed checkpoint of the lineage's newest RL run other than `before` (this night's),
    None on the first night. Newest: by run.json's `created`."""
    from infra.runs import list_runs

    found = []
    for run_id in list_runs(store):
        match = _CHAIN_RL.match(run_id)
        if match is None or match["lineage"] != lineage or run_id == before:
            continue
        step = CheckpointStore(store, run_id).resolve_loadable()
        if step is not None:
            found.append((str(RunStore(store, run_id).read_run_info()["created"]), run_id, step))
    if not found:
        return None
    _, run_id, step = max(found)
    return BaseCheckpoint(run_id, step, CheckpointStore(store, run_id).step_url(step))


def _fresh_or_resumed(config_path: str | None, overrides: list[str], run_id: str, cfg: RLConfig,
                      base: BaseCheckpoint | None, base_store: ObjectStore | None, finished: str | None
                      ) -> dict[str, Any]:
    """Resume `run_id` when it exists (the lineage's next run, or this flow run retried), else start it from
    `base` (in `base_store`), or from the config's model without one. With `finished` (what the log says),
    a run that finished all its iterations is not run again."""
    logger = get_run_logger()
    runs = RunStore(ObjectStore.from_config(cfg.storage), run_id)
    if runs.exists():
        done = runs.last_finished_iteration() or 0
        if finished is not None and done >= cfg.trainer.total_iterations:
            logger.warning("run %s finished all %d iterations: %s", run_id, done, finished)
            return {"run_id": run_id, "finished_iteration": done, "skipped": True}
        info, unsigned = runs.read_signed_run_info()
        if unsigned is not None and info.get("parent"):
            raise ConfigError(f"run {run_id}: its run.json names a parent (a checkpoint and a model folder), and "
                              f"run.json is not taken because {unsigned} (infra/record_key.py): resume it with its "
                              "record key in $RLFLOW_RECORD_KEY, or start a new run")
        model = _parent_model(info.get("parent"), cfg)
        connect_ray(ray_address(cfg), cfg)
        logger.info("resuming run %s after iteration %d", run_id, done)
        return train(config_path, [*overrides, *model], resume=run_id, run_name=run_id)
    parent, model = None, []
    if base is not None and base_store is not None:
        model_dir = base_model_dir(base, base_store, cfg.model.trust_remote_code, cfg)
        parent = {"run_id": base.run_id, "step": base.step, "checkpoint": base.url, "model_path": str(model_dir)}
        model = [f"model.path={model_dir}"]
        logger.info("new run %s from checkpoint step %d of %s", run_id, base.step, base.run_id)
    connect_ray(ray_address(cfg), cfg)
    return train(config_path, [*overrides, *model, f"trainer.run_id={run_id}"], run_name=run_id, parent=parent)


def fresh_run_id(lineage: str) -> str:
    """`<lineage>-<date>-<flow run id>`: one per flow run, the same when that flow run is retried."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        raise ConfigError("mode=fresh needs a flow run: run it through its deployment")
    run = ctx.flow_run
    stamp = f"-{run.created:%Y%m%d-%H%M%S}" if run.created else ""
    return f"{lineage}{stamp}-{run.id.hex[:8]}"


def ray_address(cfg: RLConfig) -> str:
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ConfigError("no Ray cluster to run on: run deployments with `rlflow serve` (it connects the "
                          "local stack), or set ray.address")
    return address


def _parent_model(parent: dict[str, Any] | None, cfg: RLConfig) -> list[str]:
    """The override that keeps a resumed run on the model folder made from its base checkpoint."""
    if not parent or not parent.get("model_path"):
        return []
    folder = Path(parent["model_path"])
    if not (folder / "config.json").is_file():  # another machine, or a cleared cache: make it again
        base, store = resolve_base(parent["checkpoint"], cfg)
        folder = base_model_dir(base, store, cfg.model.trust_remote_code, cfg)
    return [f"model.path={folder}"]


# -- base checkpoints ---------------------------------------------------------------------------------

_STEP_URL = re.compile(r"^(?P<root>.+)/(?P<run>[^/]+)/checkpoints/step_(?P<step>\d+)/?$")


def resolve_base(text: str, cfg: RLConfig) -> tuple[BaseCheckpoint, ObjectStore]:
    """`RUN`, `RUN:latest` or `RUN:STEP` under storage.root, or a committed step folder's URL."""
    step: int | None
    if "/" in text:
        url = text if "://" in text else str(Path(text).expanduser().resolve())
        found = _STEP_URL.match(url)
        if not found:
            raise ConfigError(f"--base-checkpoint {text!r}: expected <root>/<run>/checkpoints/step_NNNNNN")
        store = ObjectStore.from_config(cfg.storage, root=found["root"])
        run_id, step = found["run"], int(found["step"])
    else:
        run_id, _, step_text = text.partition(":")
        store = ObjectStore.from_config(cfg.storage)
        if step_text not in ("", "latest") and not step_text.isdigit():
            raise ConfigError(f"--base-checkpoint {text!r}: expected RUN, RUN:latest or RUN:STEP")
        step = int(step_text) if step_text.isdigit() else None
    ckpts = CheckpointStore(store, run_id)
    if step is None:
        step = ckpts.resolve_loadable()
        if step is None:
            raise ConfigError(f"--base-checkpoint {text!r}: run {run_id!r} has no committed checkpoint under "
                              f"{store.url()}")
    elif not ckpts.is_committed(step):
        raise ConfigError(f"--base-checkpoint {text!r}: no committed checkpoint step {step} of run {run_id!r} "
                          f"under {store.url()} (committed: {ckpts.committed_steps() or 'none'})")
    return BaseCheckpoint(run_id, step, ckpts.step_url(step)), store


def base_model_dir(base: BaseCheckpoint, store: ObjectStore, trust_remote_code: bool = False,
                   user: RLConfig | None = None) -> Path:
    """The policy weights of `base` as a Hugging Face model folder (made once, cached): the new run's
    model, so its actor, rollout copy and reference all start there; its optimizer starts afresh.
    `trust_remote_code`: the launching config's (never the base run's run.json). `user`: the launching
    config, which must give the base run's model where its run.json is not signed with the user's key."""
    from engine.models.loading import cache_dir

    digest = hashlib.sha256(base.url.encode()).hexdigest()[:10]
    out = cache_dir() / "base" / f"{base.run_id}-step_{base.step:06d}-{digest}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".making-") as tmp:
        _export_policy(base, store, Path(tmp), trust_remote_code, user)
        try:
            os.replace(Path(tmp) / "hf", out)  # atomic: a folder with config.json is complete
        except OSError:
            if not (out / "config.json").is_file():
                raise
    return out


def _export_policy(base: BaseCheckpoint, store: ObjectStore, tmp: Path, trust_remote_code: bool,
                   user: RLConfig | None) -> None:
    """Verify and fetch the step, then merge it into a model folder in a process of its own (merge_policy)
    that computes like the parent's ranks: their CPU kernels and torch threads. The parent's merged
    export of the step was computed there, and the new run starts from exactly those weights."""
    from engine.cpu_kernels import kernel_env, run_module_pinned
    from engine.state.checkpoint_io import CheckpointCorruptError
    from flows.plan import rank_threads

    info, unsigned = RunStore(store, base.run_id).read_signed_run_info()
    config = info["config"]
    if unsigned is not None:  # its model is the one the user names, or none
        _check_base_model(base, config, user, unsigned)
    parent = build_config(config)
    if parent.model.trust_remote_code != trust_remote_code:
        raise ConfigError(f"base checkpoint {base.url}: its run's run.json has model.trust_remote_code="
                          f"{parent.model.trust_remote_code!r} where your config gives {trust_remote_code!r}; what a "
                          "run executes is never taken from storage: set model.trust_remote_code yourself")
    CheckpointStore(store, base.run_id).fetch(base.step, str(tmp / "ckpt"))  # verifies every file
    (tmp / "parent.json").write_text(json.dumps(config))
    run_module_pinned("flows.deploy", [str(tmp), str(rank_threads(parent)), str(trust_remote_code)],
                      kernel_env(parent.placement.cpu_kernels), f"making the model of base checkpoint {base.url}",
                      exit_errors={CORRUPT_EXIT: CheckpointCorruptError})


# What decides the model a base checkpoint's weights are loaded into (a folder read from this machine).
BASE_MODEL_KEYS = ("model.path", "model.tokenizer_path", "model.tiny_seed", "model.dtype", "data.task")


def _check_base_model(base: BaseCheckpoint, config: dict[str, Any], user: RLConfig | None, unsigned: str) -> None:
    """ConfigError unless the base run's unsigned run.json names the model the user's config names: a
    bucket writer must not choose a folder of this machine to be read and exported into storage."""
    mine = user.model_dump(mode="json") if user is not None else {}
    for key in BASE_MODEL_KEYS:
        section, name = key.split(".")
        stored, given = config.get(section, {}).get(name), mine.get(section, {}).get(name)
        if user is None or stored != given:
            raise ConfigError(f"base checkpoint {base.url}: its run's run.json has {key}={stored!r} where your config "
                              f"gives {given!r}, and its settings are not taken because {unsigned} "
                              "(infra/record_key.py): give that model yourself, or the run's record key in "
                              "$RLFLOW_RECORD_KEY")


CORRUPT_EXIT = 3  # merge_policy's exit code when the safe reader refused the checkpoint


def merge_policy(tmp: Path, threads: int, trust_remote_code: bool) -> None:
    """In the process `_export_policy` starts: tmp/ckpt's policy shards loaded into the parent's model
    (tmp/parent.json), LoRA adapters merged, saved with the tokenizer to tmp/hf."""
    import torch

    from engine.cpu_kernels import kernel_env
    from engine.demo.tiny import resolve_model_path, resolve_tokenizer_path
    from engine.models.loading import load_model, load_tokenizer
    from engine.state.checkpoint_io import load_state

    torch.set_num_threads(threads)
    parent = build_config(json.loads((tmp / "parent.json").read_text()))
    kernels = kernel_env(parent.placement.cpu_kernels)  # this process's: the parent run's build of a tiny model
    model = load_model(resolve_model_path(parent.model, parent.data.task, kernels), dtype=parent.model.dtype,
                       trust_remote_code=trust_remote_code)
    wrapped = None
    if parent.actor.lora.enabled:  # an adapter-only checkpoint: its adapters, merged into the parent's base
        from engine.models.lora import adapter_names, apply_lora

        model, wrapped = apply_lora(model, parent.actor.lora, task="CAUSAL_LM", what="actor.lora")
        trainable = set(adapter_names(model))
        state = {"model": {k: v for k, v in model.state_dict().items() if k in trainable}}
    else:
        state = {"model": model.state_dict()}
    load_state(str(tmp / "ckpt" / "policy"), state, {})  # in place, one process; the safe reader
    model.load_state_dict(state["model"], strict=wrapped is None)
    if wrapped is not None:
        model = wrapped.merge_and_unload()
    model.save_pretrained(tmp / "hf")
    load_tokenizer(resolve_tokenizer_path(parent.model, parent.data.task, kernels),
                   trust_remote_code=trust_remote_code).save_pretrained(tmp / "hf")


# -- deployments --------------------------------------------------------------------------------------

def refuse_stored_secrets(overrides: list[str]) -> None:
    """A credential among the overrides would be stored in the deployment's parameters: refused, whatever
    else the config says (before it is read)."""
    secret = [o for o in overrides if o.partition("=")[0].strip() in SECRET_KEYS]
    if secret:
        raise ConfigError(f"{secret[0].partition('=')[0]} would be stored in the deployment's parameters: set "
                          "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment of `rlflow serve`")


def check_spec(spec: DeploySpec) -> RLConfig:
    """Refuse what would fail later, before the deployment exists."""
    from infra.layout import check_run_id

    check_run_id(spec.name)  # the lineage's run id (continue) or its prefix (fresh)
    refuse_stored_secrets(spec.overrides)
    if (spec.cron is None) == (spec.interval_s is None):
        raise ConfigError("give one schedule: --cron EXPR or --interval SECONDS")
    cfg = load_config(spec.config_path, spec.overrides)
    if spec.mode == "chain":
        return _check_chain(spec, cfg)
    if spec.then_config_path is not None or spec.then_overrides:
        raise ConfigError(f"--then runs an RL run after an SFT run (mode chain); --mode {spec.mode} runs one")
    if spec.mode == "continue":
        if cfg.trainer.iterations_per_run is None:
            raise ConfigError("--mode continue does trainer.iterations_per_run iterations per scheduled run: set "
                              "it (for example trainer.iterations_per_run=10)")
        if cfg.trainer.run_id not in (None, spec.name):
            raise ConfigError(f"trainer.run_id={cfg.trainer.run_id} differs from --name {spec.name}: the lineage's "
                              "run id is the deployment's name")
    elif cfg.trainer.run_id is not None:
        raise ConfigError("--mode fresh makes a new run id per scheduled run: leave trainer.run_id unset")
    if spec.base_checkpoint:
        resolve_base(spec.base_checkpoint, cfg)  # it must exist now, not only at 2 am
    return cfg


def _check_chain(spec: DeploySpec, sft: RLConfig) -> RLConfig:
    """Mode chain: an SFT config, then an RL config; both fresh runs each night, on one storage root."""
    if sft.algorithm.objective != "sft":
        raise ConfigError(f"--then chains an SFT run and an RL run: the first config's algorithm.objective is "
                          f"{sft.algorithm.objective!r} (give an SFT config, as configs/tiny_sft.yaml)")
    rl = load_config(spec.then_config_path, list(spec.then_overrides or []))
    if rl.algorithm.objective == "sft":
        raise ConfigError("--then's config is an SFT config: the chain's second run trains on the SFT run's "
                          "checkpoint with RL (or DPO, or distillation)")
    if spec.base_checkpoint:
        raise ConfigError("--base-checkpoint with --then: the first night's SFT run starts from its config's model, "
                          "every later one from the lineage's last RL checkpoint")
    for cfg, which in ((sft, "the SFT config"), (rl, "--then's config")):
        if cfg.trainer.run_id is not None:
            raise ConfigError(f"trainer.run_id in {which}: the chain names its runs <name>-<date>-<flow run>-sft / -rl")
    if rl.storage.root != sft.storage.root:
        raise ConfigError(f"storage.root differs between the SFT config ({sft.storage.root}) and --then's "
                          f"({rl.storage.root}): a lineage's runs live under one root")
    return sft


def runner_deployment(name: str, parameters: dict[str, Any], *, collision: Collision,
                      schedules: list[Any] | None = None, cron: str | None = None,
                      interval_s: float | None = None, timezone: str | None = None,
                      paused: bool | None = None) -> Any:
    """The deployment of `scheduled_train`: one schedule, at most one run at a time."""
    from flows.plan import code_version

    schedule: dict[str, Any] = {}
    if schedules is not None:
        schedule["schedules"] = schedules
    elif cron is not None:
        from prefect.schedules import Cron

        schedule["schedule"] = Cron(cron, timezone=timezone) if timezone else Cron(cron)
    elif interval_s is not None:
        schedule["interval"] = interval_s
    return scheduled_train.to_deployment(
        name=name, parameters=parameters, paused=paused, tags=["rlflow", f"lineage:{name}"],
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=_STRATEGY[collision]),
        version=code_version(), entrypoint_type=EntrypointType.MODULE_PATH, **schedule,
    )


def deploy(spec: DeploySpec) -> UUID:
    """Create or update the deployment `rlflow-scheduled/<name>` in the Prefect API."""
    check_spec(spec)
    deployment = runner_deployment(spec.name, spec.parameters(), collision=spec.collision, cron=spec.cron,
                                   interval_s=spec.interval_s, timezone=spec.timezone)
    if spec.pool is None:
        return UUID(str(deployment.apply()))
    ensure_work_pool(spec.pool)
    # No code storage and no pull steps: a worker runs the flow by its module path, so rlflow must be
    # installed where the worker runs (as on every Ray node).
    return UUID(str(deployment.apply(work_pool_name=spec.pool)))


def ensure_work_pool(name: str) -> None:
    """The process work pool `name`, created when absent; another type is refused (it would run the flow
    in a container or a job that is not a Ray driver here)."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            return
    if pool.type != "process":
        raise ConfigError(f"--pool {name}: a work pool of type {pool.type!r}; rlflow deploys to process pools "
                          "(the worker's process runs the flow as a Ray driver)")


def read_deployments(names: list[str] | None = None) -> list[Any]:
    """The rlflow deployments in the Prefect API (all, or those named)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        found = client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME])))
    if names:
        missing = sorted(set(names) - {d.name for d in found})
        if missing:
            raise ConfigError(f"no rlflow deployment named {', '.join(missing)} (create it with `rlflow deploy`)")
        found = [d for d in found if d.name in names]
    return list(found)


def served(api: Any) -> Any:
    """A deployment as the API holds it (schedules, pause, parameters edited in the UI), to serve."""
    from prefect.client.schemas.actions import DeploymentScheduleCreate

    strategy = api.concurrency_options.collision_strategy if api.concurrency_options else None
    collision: Collision = "cancel-new" if strategy == ConcurrencyLimitStrategy.CANCEL_NEW else "enqueue"
    schedules = [DeploymentScheduleCreate(schedule=s.schedule, active=s.active) for s in api.schedules]
    return runner_deployment(api.name, dict(api.parameters), collision=collision, schedules=schedules,
                             paused=api.paused)


def serve_deployments(names: list[str] | None = None, limit: int | None = None) -> None:
    """Execute the runs of the rlflow deployments until interrupted. The schedules stay active when this
    process stops: runs that come due meanwhile wait (Late) and execute, one at a time, once it is back."""
    from prefect import serve

    found = read_deployments(names)
    pooled = [d.name for d in found if d.work_pool_name]
    if names and pooled:
        raise ConfigError(f"deployment {', '.join(pooled)} runs on a work pool: its workers execute its runs "
                          "(`prefect worker start --pool POOL`), not `rlflow serve`")
    deployments = [served(d) for d in found if not d.work_pool_name]  # serving one would take it off its pool
    if not deployments:
        raise ConfigError("no rlflow deployments to serve: create one with `rlflow deploy`")
    print(f"rlflow: serving {', '.join(f'{FLOW_NAME}/{d.name}' for d in deployments)}", flush=True)
    serve(*deployments, pause_on_shutdown=False, limit=limit)


if __name__ == "__main__":  # python -m flows.deploy TMP THREADS TRUST_REMOTE_CODE: merge_policy's process
    from engine.state.checkpoint_io import CheckpointCorruptError

    try:
        merge_policy(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "True")
    except CheckpointCorruptError as err:
        print(err, file=sys.stderr)
        sys.exit(CORRUPT_EXIT)
