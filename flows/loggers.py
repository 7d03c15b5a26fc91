"""Metric loggers: TensorBoard, Weights & Biases (offline) and MLflow (a local SQLite store).

    loggers = MetricLoggers.create(cfg.trainer.loggers, run_id=run_id, config=cfg.public_dict(),
                                   log_dir=run_log_dir(cfg.trainer.log_dir, storage_root=cfg.storage.root,
                                                       run_id=run_id))
    loggers.log(7, {"critic/score/mean": 0.41, "timing_s/step": 12.3})   # once per finished iteration
    loggers.close()

Every backend writes to a local folder (the storage root may be S3) and none reaches the network:

- `tensorboard`: tensorboardX's event files in `<log_dir>/tensorboard` (`tensorboard --logdir` reads
  them). tensorboardX, not torch.utils.tensorboard: the latter needs the `tensorboard` package and
  its dependencies (19 MB) only to write the same files; tensorboardX is 92 kB on protobuf and numpy.
- `wandb`: an offline run in `<log_dir>/wandb/offline-run-*-<run_id>`; `wandb sync` uploads it later.
  WANDB_MODE=online in the environment is the one way to make it go online.
- `mlflow`: a SQLite tracking store `<log_dir>/mlflow.db` (MLflow 3 refuses the `file:` store,
  "maintenance mode"), artifacts in `<log_dir>/mlartifacts`. MLFLOW_TRACKING_URI, when set, wins:
  a team server. `mlflow ui --backend-store-uri sqlite:///<log_dir>/mlflow.db` shows the local one.

A resumed run logs into the same W&B id and the same MLflow run (found by its `rlflow.run_id` tag).
Backends are imported when created; a configured backend whose package is missing is one
`ConfigError` naming the extra to install, before anything starts. A backend that fails while
logging is switched off with a warning: metrics.jsonl stays the record of the run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import numbers
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, get_args

from engine.errors import ConfigError

log = logging.getLogger("rlflow.loggers")

LoggerName = Literal["tensorboard", "wandb", "mlflow"]
LOGGER_NAMES: tuple[str, ...] = get_args(LoggerName)
EXTRA = "loggers"  # pip install 'rlflow[loggers]'


@dataclass(frozen=True)
class _Package:
    module: str  # what the backend imports
    pip: str  # what provides it


PACKAGES: dict[str, _Package] = {
    "tensorboard": _Package("tensorboardX", "tensorboardX"),
    "wandb": _Package("wandb", "wandb"),
    "mlflow": _Package("mlflow", "mlflow-skinny"),
}


class MetricLogger(Protocol):
    name: str

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self, *, failed: bool = False) -> None: ...


# ---------------------------------------------------------------------------------------------------
# the facade


class MetricLoggers:
    """The configured backends behind one `log` / `close`. Empty (no backends) is valid and does nothing."""

    def __init__(self, loggers: Iterable[MetricLogger] = ()) -> None:
        self.loggers = list(loggers)
        self._warned_keys: set[str] = set()

    @classmethod
    def create(
        cls, names: Iterable[str], *, run_id: str, log_dir: str | Path, config: Mapping[str, Any],
        project: str = "rlflow",
    ) -> MetricLoggers:
        """Start each backend in `names` for `run_id`, writing under `log_dir`; `config` (the public,
        JSON-able run config) is recorded as the run's config / params; `project` (trainer.project) is
        the W&B project and the MLflow experiment."""
        names = list(dict.fromkeys(names))
        if not names:
            return cls()
        require_packages(names)
        directory = Path(log_dir).expanduser().resolve()
        directory.mkdir(parents=True, exist_ok=True)
        started: list[MetricLogger] = []
        try:
            for name in names:
                started.append(_create_backend(name, run_id=run_id, log_dir=directory, config=config,
                                               project=project))
        except BaseException:
            for logger in started:
                logger.close(failed=True)
            raise
        return cls(started)

    @property
    def names(self) -> list[str]:
        return [logger.name for logger in self.loggers]

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one finished iteration. Values that are not real numbers are left out (warned once)."""
        scalars = self._scalars(metrics)
        for logger in list(self.loggers):
            try:
                logger.log(step, scalars)
            except Exception as err:  # noqa: BLE001 - a logger must not stop training; metrics.jsonl has it
                log.warning("the %s logger failed at step %d and is switched off for this run: %s",
                            logger.name, step, err)  # fmt: skip
                self.loggers.remove(logger)
                _close_quietly(logger, failed=True)

    def close(self, *, failed: bool = False) -> None:
        """Flush and close every backend; `failed` marks the run failed where the backend records it."""
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            _close_quietly(logger, failed=failed)

    def __enter__(self) -> MetricLoggers:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(failed=kind is not None)

    def _scalars(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        scalars = {}
        for key, value in metrics.items():
            if isinstance(value, numbers.Real):
                scalars[key] = float(value)
            elif key not in self._warned_keys:
                self._warned_keys.add(key)
                log.warning("metric %r is %s, not a number: not logged", key, type(value).__name__)
        return scalars


def _close_quietly(logger: MetricLogger, *, failed: bool) -> None:
    try:
        logger.close(failed=failed)
    except Exception as err:  # noqa: BLE001 - closing one backend must not skip the others
        log.warning("closing the %s logger failed: %s", logger.name, err)


# ---------------------------------------------------------------------------------------------------
# where and what


def run_log_dir(log_dir: str | None, *, storage_root: str, run_id: str) -> Path:
    """The local folder of one run's logger files.

    `trainer.log_dir` set: `<log_dir>/<run_id>` (one folder per run: `tensorboard --logdir <log_dir>`
    compares runs). Unset: `<storage root>/<run_id>/logs` when the root is a local folder, else
    `./runs/<run_id>/logs` (loggers write local files; an S3 root cannot hold them).
    """
    if log_dir is not None:
        return Path(log_dir.removeprefix("file://")).expanduser().resolve() / run_id
    root = storage_root.removeprefix("file://")
    if "://" in root:
        root = "./runs"
    return Path(root).expanduser().resolve() / run_id / "logs"


def missing_packages(names: Iterable[str]) -> list[str]:
    """The pip packages that the backends in `names` need and that are not installed."""
    missing = []
    for name in dict.fromkeys(names):
        package = PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package.module) is None:
            missing.append(package.pip)
    return missing


def install_hint(packages: Iterable[str] = ()) -> str:
    listed = " ".join(packages)
    return f"pip install 'rlflow[{EXTRA}]'" + (f" (or: pip install {listed})" if listed else "")


def require_packages(names: Iterable[str]) -> None:
    """One ConfigError for every unknown name or missing package in `names`."""
    names = list(names)
    unknown = [name for name in names if name not in PACKAGES]
    if unknown:
        raise ConfigError(f"trainer.loggers={names!r} is not allowed: unknown logger "
                          f"{', '.join(map(repr, unknown))}; allowed: {', '.join(LOGGER_NAMES)}")  # fmt: skip
    missing = missing_packages(names)
    if missing:
        raise ConfigError(f"trainer.loggers={names!r} needs {', '.join(missing)}, not installed: "
                          f"{install_hint(missing)}, or leave the logger out of trainer.loggers")  # fmt: skip


def _create_backend(name: str, *, run_id: str, log_dir: Path, config: Mapping[str, Any], project: str
                    ) -> MetricLogger:
    backends: dict[str, Callable[..., MetricLogger]] = {
        "tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger,
    }  # fmt: skip
    backend = backends[name]
    try:
        return backend(run_id=run_id, log_dir=log_dir, config=config, project=project)
    except ImportError as err:  # installed but broken: a dependency of its own is missing
        package = PACKAGES[name].pip
        raise ConfigError(f"trainer.loggers: {name} needs {package}, which does not import ({err}): "
                          f"{install_hint([package])}") from None  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# backends


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, *, run_id: str, log_dir: Path, config: Mapping[str, Any], project: str) -> None:
        import tensorboardX as tbx

        self.path = log_dir / "tensorboard"
        self.writer = tbx.SummaryWriter(logdir=str(self.path))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # once per iteration: a crash loses nothing, and the UI is current

    def close(self, *, failed: bool = False) -> None:
        self.writer.close()


class WandbLogger:
    name = "wandb"

    def __init__(self, *, run_id: str, log_dir: Path, config: Mapping[str, Any], project: str) -> None:
        wanted = os.environ.get("WANDB_MODE", "").lower()
        mode: Literal["online", "offline", "disabled"] = "offline"
        if wanted in ("online", "disabled"):
            mode = wanted  # type: ignore[assignment]
        if mode != "online":
            # wandb-core otherwise reports its own errors to W&B's servers; it reads this when it starts.
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        settings = wandb.Settings(
            console="off",  # the flow's own output stays as it is
            x_disable_stats=True,  # no system-metrics sampler thread beside the engine
            silent=True,
            save_code=False,
            disable_git=True,
            disable_job_creation=True,
        )
        self.run = wandb.init(
            project=project, id=_wandb_id(run_id), name=run_id, dir=str(log_dir), mode=mode,
            config=dict(config), resume="allow", reinit="create_new", settings=settings,
        )  # fmt: skip

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, *, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _wandb_id(run_id: str) -> str:
    # W&B run ids may not hold / \ # ? % : (wandb.sdk.lib.runid); rlflow's run ids normally have none.
    return re.sub(r"[/\\#?%:]", "-", run_id)[:128]


class MlflowLogger:
    name = "mlflow"
    RUN_TAG = "rlflow.run_id"
    # MLflow's log_batch takes at most 100 params and 1000 metrics per call.
    PARAMS_PER_CALL, METRICS_PER_CALL = 100, 1000

    def __init__(self, *, run_id: str, log_dir: Path, config: Mapping[str, Any], project: str) -> None:
        # `import mlflow` starts a telemetry thread that fetches a config from mlflow.org (MLflow >= 3.2)
        # unless this is set first. MLFLOW_DISABLE_TELEMETRY=false in the environment keeps it on.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.metric_type = Metric
        # SQLite, not `file:`: MLflow 3 refuses the file store. sqlalchemy and alembic, which
        # mlflow-skinny leaves out, come with prefect.
        server = os.environ.get("MLFLOW_TRACKING_URI")
        self.client = MlflowClient(tracking_uri=server or f"sqlite:///{log_dir / 'mlflow.db'}")
        # Artifacts beside the local store; a server keeps its own artifact location.
        artifacts = None if server else (log_dir / "mlartifacts").as_uri()
        experiment = self._experiment(project, artifacts)
        found = self.client.search_runs([experiment], filter_string=f"tags.`{self.RUN_TAG}` = '{run_id}'",
                                        max_results=1)  # fmt: skip
        if found:  # a resumed run goes on in the same MLflow run
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(experiment, run_name=run_id, tags={self.RUN_TAG: run_id})
        self.run_id = run.info.run_id
        params = [Param(key, value) for key, value in _flat_params(config).items()]
        for start in range(0, len(params), self.PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[start:start + self.PARAMS_PER_CALL])

    def _experiment(self, name: str, artifacts: str | None) -> str:
        existing = self.client.get_experiment_by_name(name)
        if existing is not None:
            return str(existing.experiment_id)
        return str(self.client.create_experiment(name, artifact_location=artifacts))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self.metric_type(key, value, now, step) for key, value in metrics.items()]
        for start in range(0, len(batch), self.METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=batch[start:start + self.METRICS_PER_CALL])

    def close(self, *, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"actor": {"lr": 1e-5}}` -> `{"actor.lr": "1e-05"}`; MLflow params are strings of <= 6000 chars."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flat_params(value, prefix=f"{name}."))
        elif value is not None:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            flat[name[:250]] = text[:6000]
    return flat
