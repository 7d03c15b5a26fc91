"""Names inside a run's folder (docs/architecture.md "Object storage"): one place that spells them."""

from __future__ import annotations

import re

from infra.errors import StoreError

RUN_JSON = "run.json"
LOCK_JSON = "lock.json"
METRICS_DIR = "metrics"
BUFFERS_DIR = "buffers"
CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "export"
MANIFEST = "MANIFEST.json"
LATEST = "LATEST"
TRAINER_JSON = "trainer.json"

# A run id names the run's folder (and, in the engine, its Ray actors: engine.workers.group.RUN_ID, held
# equal by tests/test_layers.py). fullmatch: `$` lets a final newline through.
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ITER = re.compile(r"^iter_(\d{6,})$")
_STEP = re.compile(r"^step_(\d{6,})$")
_METRICS_FILE = re.compile(r"^iter_(\d{6,})\.json$")
_BUFFER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def artifact_key(run_id: str, what: str) -> str:
    """A run's Prefect artifact key: artifact keys may hold lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-{what}".lower()).strip("-")


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise StoreError(f"run id {run_id!r} must be 1-128 letters, digits, '.', '_' or '-' "
                         "and start with a letter or digit")
    return run_id


def check_buffer_name(name: str) -> str:
    if not _BUFFER_NAME.match(name):
        raise StoreError(f"buffer name {name!r} must be letters, digits, '_' or '-' (e.g. 'rollout')")
    return name


def iter_dir(iteration: int) -> str:
    """`iter_000007`."""
    if iteration < 0:
        raise StoreError(f"iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:06d}"


def step_dir(step: int) -> str:
    """`step_000007`."""
    if step < 0:
        raise StoreError(f"checkpoint step must be >= 0, got {step}")
    return f"step_{step:06d}"


def parse_iter_dir(name: str) -> int | None:
    m = _ITER.match(name)
    return int(m.group(1)) if m else None


def parse_step_dir(name: str) -> int | None:
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def parse_metrics_file(name: str) -> int | None:
    m = _METRICS_FILE.match(name)
    return int(m.group(1)) if m else None
