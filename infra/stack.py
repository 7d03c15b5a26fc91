"""The local stack: a Prefect API server and a Ray head node on this machine, started when absent.

    info = ensure_stack()                    # what `rlflow train` calls: start what is missing, reuse the rest
    apply_connect_env(info)                  # before ray.init / the flow: PREFECT_API_URL, RAY_ADDRESS, Ray token
    @flow(task_runner=RayTaskRunner(address=info.ray_address, init_kwargs={"namespace": "rlflow"}))

    LocalStack().up() / .down() / .status()  # `rlflow up | down | status`

State folder (`$RLFLOW_HOME`, default ~/.rlflow):

    stack/prefect.json  stack/ray.json       what runs: PID, process start time, port (one file per service)
    stack/prefect.log   stack/ray.log        their output
    stack/lock                               serialises up/down of concurrent commands
    stack/ray_auth_token                     the Ray head's token (mode 0600)
    stack/prefect_auth                       the Prefect API's auth string (mode 0600; the UI asks for it)
    prefect/                                 the Prefect server's PREFECT_HOME and its SQLite database

Why it is built this way (measured on the 2-core dev machine with Prefect 3.9 and Ray 2.60):

- Prefect's ephemeral mode starts one API server per Ray worker, all on one SQLite file ("database is
  locked"): a real `prefect server start` is needed. Its URL reaches the Ray workers inside the task
  context Prefect ships with every task, so the head node needs no PREFECT_API_URL.
- A RayTaskRunner that starts Ray shuts it down when the flow ends, killing the detached engine: the
  head runs here, in its own session (`ray start --block`; SIGTERM to it stops every Ray process).
- Ray token authentication is on by default (`ray_auth="token"`), with rlflow's own token file in the
  state folder. Ray's defaults are a trap here: `ray start --head` switches auth on when ~/.ray/auth_token
  exists (any local `ray.init()` writes it), while `ray.init(address=...)` never does, so a client fails
  after ~20 s with "Authentication token is missing". Setting RAY_AUTH_MODE explicitly on both sides
  removes the dependence on that file. Ray reads RAY_AUTH_* when it is imported: see apply_connect_env.
- RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0: on SIGTERM Ray 2.60 otherwise drains the node for 30 s,
  which never finishes while a detached actor lives (there is no Serve here to quiesce).
- No log monitor (`--include-log-monitor=false`): every rlflow driver connects with log_to_driver=False,
  and workers' output stays in the session's log files. Ray's monitor polls those files ten times a
  second to publish their new lines to the drivers. In the test suite the log monitors used 7 % of all
  CPU time (237 of 3,470 CPU seconds sampled per process over the last 31 minutes of a whole run,
  2026-12-02; docs/testing.md).
- No prestarted workers (RAY_prestart_worker_first_driver=0, read by the raylet): Ray starts one idle
  worker per CPU for the first driver that joins a node, and only that driver's job can use them. Here
  the first driver is whichever command came first (often `rlflow status`, a check or an engine command
  that runs no task), and every run is a driver of its own: in the test suite 76 such workers started
  and never ran anything (158 CPU seconds). Workers start when a task or an actor needs one.
- Ray's temp dir is /tmp/rlflow-ray-<hash of the state folder>/ray: its socket paths must fit in 107 bytes; Ray makes
  it 0777, so the folder above it is ours, 0700.
- The Prefect API requires a credential: Prefect's API auth string (PREFECT_SERVER_API_AUTH_STRING), random,
  kept in stack/prefect_auth; every request but /api/health and /api/ready needs it (HTTP Basic, and the
  first message of a websocket). It reaches the flow process through its environment (connect_env) and the
  Ray workers inside the settings Prefect ships with every task, never through Ray's runtime environment
  (Ray logs that). State changes also need a CSRF token (Prefect's clients and UI fetch one), and CORS
  grants only the stack's own UI origin. On a shared machine any local user could otherwise drive the
  API: create a run of a deployment with overrides that name code.
- Loopback only: on Linux Ray replaces `--node-ip-address=127.0.0.1` by the host's address, and its
  gRPC servers (GCS, raylet) then listen on all interfaces and its agents on the host's address.
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 selects Ray's single-machine mode (its default on macOS and
  Windows): the node IP stays 127.0.0.1, and every Ray process then listens on 127.0.0.1 only
  (tests/ops/test_credentials.py checks each listening socket). The head accepts no other nodes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, MutableMapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from infra.config import RayConfig, StackConfig
from infra.errors import InfraError
from infra.node import READY_LINE, free_port

logger = logging.getLogger(__name__)

STAGE_RESOURCE = "rlflow_stage"  # the custom Ray resource that caps how many stage tasks run at once
# The engine's rank actors take one logical CPU each: 2 policy + 2 critic ranks for the default world
# size 2. Logical CPUs may exceed the cores (the ranks mostly take turns), so the head gets at least 4.
ENGINE_MIN_CPUS = 4
HOST = "127.0.0.1"

ServiceName = Literal["prefect", "ray", "node"]
SERVICES: tuple[ServiceName, ...] = ("prefect", "ray")
JOINED: tuple[ServiceName, ...] = ("node",)  # a state folder that joined another stack's head
State = Literal["running", "unhealthy", "stale", "stopped"]

_RAY_READY_LINE = b"Ray runtime started"  # what `ray start` prints once the node has registered
_LOG_ROTATE_BYTES = 16 * 2**20
# Inherited settings that would point a service at something other than this stack.
_PREFECT_DROP = (
    "PREFECT_API_URL",
    "PREFECT_API_KEY",
    "PREFECT_API_AUTH_STRING",
    "PREFECT_SERVER_API_AUTH_STRING",
    "PREFECT_SERVER_CSRF_",
    "PREFECT_SERVER_CORS_",
    "PREFECT_PROFILE",
    "PREFECT_SERVER_DATABASE_",
    "PREFECT_API_DATABASE_",
    "RLFLOW_RECORD_KEY",  # the services never sign a record: the key stays out of their processes
)
_RAY_DROP = (
    "RLFLOW_RECORD_KEY",
    "RAY_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
)
# Ray's single-machine mode: the node IP stays 127.0.0.1 and nothing listens beyond loopback (see above).
_RAY_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
_RAY_NO_PRESTART = {"RAY_prestart_worker_first_driver": "0"}  # see the module docstring

_SPAWNED: dict[int, subprocess.Popen[bytes]] = {}  # children of this process, polled so they are reaped


@dataclass(frozen=True)
class StackInfo:
    """Where a flow process finds the stack."""

    prefect_api_url: str
    ray_address: str
    ui_url: str
    # None: not our head (an external cluster); its auth comes from the environment as it is.
    ray_auth: Literal["token", "disabled"] | None = None
    ray_token_path: str | None = None
    ray_loopback: bool = False  # our head in Ray's single-machine mode: clients must use it too
    # Our Prefect server's auth string file (None: an external API, or a server started without one).
    prefect_auth_path: str | None = None


@dataclass(frozen=True)
class ProcessRecord:
    """What `up` wrote about a service it started: enough to find, check and stop it later."""

    pid: int
    start_ticks: int | None  # the process's start time, so that a reused PID is not taken for ours
    port: int
    log: str
    log_offset: int  # the log's size before this start: readiness lines are looked for after it
    started_at: float
    temp_dir: str | None = None  # ray only, from here on
    auth: Literal["token", "disabled"] | None = None
    num_cpus: int | None = None
    stage_slots: int | None = None
    loopback: bool = False  # started with _RAY_LOOPBACK (heads recorded before it listen beyond)
    join: str | None = None  # node only: the head it joined
    # node: the head's token it joined with; prefect (auth "token"): the file of the API's auth string
    token_file: str | None = None


@dataclass(frozen=True)
class ServiceStatus:
    name: ServiceName
    state: State
    address: str | None = None
    pid: int | None = None
    log: str | None = None
    detail: str = ""
    record: ProcessRecord | None = field(default=None, repr=False)


@dataclass(frozen=True)
class StackStatus:
    home: Path
    prefect: ServiceStatus
    ray: ServiceStatus
    node: ServiceStatus | None = None  # a worker node of another stack's head (`rlflow up --join`)

    @property
    def running(self) -> bool:
        return self.prefect.state == "running" and self.ray.state == "running"

    def info(self) -> StackInfo:
        if not self.running:
            raise InfraError(f"the local stack is not running (prefect: {self.prefect.state}, ray: "
                             f"{self.ray.state}); start it with `rlflow up`")  # fmt: skip
        prefect = _record(self, "prefect")
        return _stack_info(prefect_api_url(prefect.port), _record(self, "ray"), self.home, prefect)

    @property
    def ray_running(self) -> bool:
        return self.ray.state == "running"

    @property
    def ray_address(self) -> str | None:
        """The head's address when it runs (also when Prefect does not)."""
        return self.ray.address if self.ray_running else None


def _check_join(address: str) -> None:
    host, _, port = address.rpartition(":")
    if host not in (HOST, "localhost") or not port.isdigit():
        raise InfraError(f"--join {address}: must be 127.0.0.1:PORT, a stack's Ray head on this machine (it listens "
                         "on 127.0.0.1 only); another machine joins a Ray cluster with `ray start --address` "
                         "(docs/operations.md)")


def prefect_api_url(port: int) -> str:
    return f"http://{HOST}:{port}/api"


def resolve_home(home: str | Path | None = None) -> Path:
    """The state folder: `home`, else $RLFLOW_HOME, else ~/.rlflow."""
    chosen = home or os.environ.get("RLFLOW_HOME") or "~/.rlflow"
    return Path(chosen).expanduser().resolve()


def token_path(home: Path) -> Path:
    return home / "stack" / "ray_auth_token"


def prefect_auth_path(home: Path) -> Path:
    return home / "stack" / "prefect_auth"


def read_prefect_auth(path: str | Path) -> str:
    """The Prefect API's auth string, from its file (mode 0600)."""
    try:
        value = Path(path).read_text().strip()
    except OSError as err:
        raise InfraError(f"cannot read the Prefect API's auth string {path}: {err.strerror}; `rlflow down` and "
                         "`rlflow up` make a new one") from None
    if not value:
        raise InfraError(f"the Prefect API's auth string file {path} is empty; remove it, `rlflow down` and "
                         "`rlflow up` again")
    return value


def ray_temp_dir(home: Path) -> Path:
    """Ray's temp folder: short and fixed per state folder (Ray's socket paths below it must fit in 107
    bytes), inside a folder of ours made 0700 (`private_temp_dir(ray_temp_dir(home).parent)`). Ray makes
    the folder it is given, and each it makes below, world-writable (ray._common.utils.try_to_create_directory
    chmods it 0777 at every node start): the private folder above is what keeps other users out."""
    digest = hashlib.sha256(str(home).encode()).hexdigest()[:10]
    return Path("/tmp") / f"rlflow-ray-{digest}" / "ray"


def private_temp_dir(path: Path, what: str = "Ray's temp folder", *, parents: bool = False) -> Path:
    """`path` made with mode 0700, or checked when it is there: a folder (not a link) of this user, no one
    else's access (tightened when it is ours and open). Ray keeps its sockets, session and logs there,
    under /tmp, where anyone can make the folder first; the state folder holds the stack's secrets."""
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise InfraError(f"{what} {path} is not a folder (a link or a file): remove it, then start again")
    if info.st_uid != os.getuid():
        raise InfraError(f"{what} {path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): "
                         "someone else made it first; remove it (it is never shared), then start again")
    if info.st_mode & 0o077:
        path.chmod(0o700)
    return path


def private_state_dir(home: Path) -> Path:
    """The state folder and its `stack/` and `prefect/` folders, each 0700 (tightened when ours and open):
    they hold the Ray token, the Prefect API's auth string, the record key and Prefect's database (runs'
    parameters and logs). Their files are made 0600 (the services run with umask 077)."""
    private_temp_dir(home, "the state folder", parents=True)
    for name in ("stack", "prefect"):
        private_temp_dir(home / name, "the state folder's")
    return home


def default_num_cpus() -> int:
    return max(os.cpu_count() or 1, ENGINE_MIN_CPUS)


class LocalStack:
    """The Prefect server and the Ray head of one state folder. Every method is safe to call again."""

    def __init__(self, config: StackConfig | None = None, *, stage_slots: int | None = None) -> None:
        self.config = config or StackConfig()
        self.home = resolve_home(self.config.home)
        # One default for the cap: the run config's ray.max_concurrent_stages.
        self.stage_slots = stage_slots or RayConfig.model_fields["max_concurrent_stages"].default
        self.num_cpus = default_num_cpus() if self.config.num_cpus is None else self.config.num_cpus
        self.services = JOINED if self.config.join else SERVICES
        if self.config.join:
            _check_join(self.config.join)

    # -- the three commands -------------------------------------------------------------------------

    def status(self) -> StackStatus:
        node = self._service_status("node")
        return StackStatus(self.home, self._service_status("prefect"), self._service_status("ray"),
                           None if node.state == "stopped" else node)

    def up(self, services: tuple[ServiceName, ...] | None = None) -> StackStatus:
        """Start every service in `services` (default: the stack's, or its worker node) that is not
        running; reuse those that are."""
        services = self.services if services is None else services
        details: dict[str, str] = {}
        with self._lock():
            before = {name: self._service_status(name) for name in services}
            started: dict[ServiceName, ProcessRecord] = {}
            for name, status in before.items():  # start all first: they boot in parallel
                if status.state in ("running", "unhealthy"):
                    continue  # unhealthy: perhaps still booting; waited for below
                if status.state == "stale" and status.record is not None:
                    self._stop(status.record)  # leftovers of the dead leader's session go too
                    self._record_path(name).unlink(missing_ok=True)
                started[name] = self._spawn(name)
            deadline = time.monotonic() + self.config.start_timeout_s
            for name, status in before.items():
                if status.state == "running":
                    details[name] = "already running" + self._differences(name, status.record)
                    continue
                record = started.get(name) or status.record
                assert record is not None
                self._wait_ready(name, record, deadline)
                details[name] = f"started in {time.time() - record.started_at:.1f} s"
        now = self.status()
        return replace(now, **{name: replace(getattr(now, name), detail=d) for name, d in details.items()
                               if getattr(now, name) is not None})

    def down(self) -> list[str]:
        """Stop what `up` started, by the recorded PIDs. Returns one line per service."""
        lines = []
        with self._lock():
            # A state folder holds a stack or a joined node: the lines are about the one it holds.
            joined = self._read_record("node") is not None
            for name in JOINED if joined else SERVICES:
                record = self._read_record(name)
                if record is None:
                    lines.append(f"{name}: not running")
                    continue
                lines.append(f"{name}: {self._stop(record)}")
                self._record_path(name).unlink(missing_ok=True)
            # the runs' credential files for their Ray workers (flows/train.credentials_file): the stack
            # that ran them is gone, and a run's process removes its own when it ends
            shutil.rmtree(self.home / "credentials", ignore_errors=True)
        return lines

    def _differences(self, name: ServiceName, record: ProcessRecord | None) -> str:
        """What the running service has that this config would not: it is reused as it is."""
        if record is None:
            return ""
        if name == "node":
            return f" (joined {record.join}: `rlflow down` first to change)" if record.join != self.config.join else ""
        wanted = {"port": self.config.prefect_port if name == "prefect" else self.config.ray_port}
        if name == "prefect" and record.auth != "token":
            return " (its API has no auth string: `rlflow down` first to lock it)"
        if name == "ray":
            wanted.update(num_cpus=self.num_cpus, stage_slots=self.stage_slots)
        differ = [f"{key} {getattr(record, key)}, not {value}" for key, value in wanted.items()
                  if getattr(record, key) != value]  # fmt: skip
        return f" ({'; '.join(differ)}: `rlflow down` first to change)" if differ else ""

    # -- one service ------------------------------------------------------------------------------

    def _service_status(self, name: ServiceName) -> ServiceStatus:
        record = self._read_record(name)
        if record is None:
            return ServiceStatus(name, "stopped", detail="not running")
        address = prefect_api_url(record.port) if name == "prefect" else record.join or f"{HOST}:{record.port}"
        if not _alive(record.pid, record.start_ticks):
            state: State = "stale"
            detail = f"process {record.pid} is gone (stale record)"
        elif self._healthy(name, record):
            state, detail = "running", "healthy"
        else:
            state, detail = "unhealthy", f"process {record.pid} runs but {address} does not answer"
        return ServiceStatus(name, state, address, record.pid, record.log, detail, record)

    def _healthy(self, name: ServiceName, record: ProcessRecord) -> bool:
        if name == "prefect":
            return _prefect_health(record.port)
        if name == "node":  # registered with the head once it prints its line
            return _log_has(Path(record.log), record.log_offset, READY_LINE.encode())
        return _port_open(record.port) and _log_has(Path(record.log), record.log_offset, _RAY_READY_LINE)

    def _spawn(self, name: ServiceName) -> ProcessRecord:
        if name == "node":
            assert self.config.join is not None
            cmd, env = self._node_command(self.config.join)
            port = int(self.config.join.rsplit(":", 1)[1])
        else:
            port = self.config.prefect_port if name == "prefect" else self.config.ray_port
            cmd, env = self._prefect_command(port) if name == "prefect" else self._ray_command(port)
        if name != "node" and _port_taken(port):
            option = "--prefect-port" if name == "prefect" else "--ray-port"
            raise InfraError(f"cannot start {name} on port {port}: another process uses it "
                             f"(choose another with `rlflow up {option} P`)")  # fmt: skip
        log = self.home / "stack" / f"{name}.log"
        _rotate(log)
        offset = log.stat().st_size if log.exists() else 0
        with open(log, "ab", opener=lambda name, flags: os.open(name, flags, 0o600)) as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            out.flush()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=self.home, start_new_session=True, umask=0o077)  # fmt: skip
        _SPAWNED[proc.pid] = proc
        record = ProcessRecord(pid=proc.pid, start_ticks=_start_ticks(proc.pid), port=port, log=str(log),
                               log_offset=offset, started_at=time.time())  # fmt: skip
        if name == "prefect":
            record = replace(record, auth="token", token_file=str(prefect_auth_path(self.home)))
        if name == "ray":
            record = replace(record, temp_dir=str(ray_temp_dir(self.home)), auth=self.config.ray_auth,
                             num_cpus=self.num_cpus, stage_slots=self.stage_slots, loopback=True)  # fmt: skip
        if name == "node":
            token = env.get("RAY_AUTH_TOKEN_PATH")
            record = replace(record, temp_dir=str(ray_temp_dir(self.home)), auth="token" if token else "disabled",
                             num_cpus=self.num_cpus, stage_slots=self.stage_slots, loopback=True,
                             join=self.config.join, token_file=token)  # fmt: skip
        self._write_record(name, record)
        return record

    def _prefect_command(self, port: int) -> tuple[list[str], dict[str, str]]:
        prefect_home = self.home / "prefect"
        prefect_home.mkdir(parents=True, exist_ok=True)
        env = _env_without(_PREFECT_DROP)
        env.update(
            PREFECT_HOME=str(prefect_home),
            PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{prefect_home / 'prefect.db'}",
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_SERVER_LOGGING_LEVEL="WARNING",
            # The UI's own API address: `--port` does not reach it, and it would default to port 4200
            # (whatever server runs there) for a stack on another port.
            PREFECT_SERVER_UI_API_URL=prefect_api_url(port),
            # Locked (module docstring): a credential for every request, a CSRF token for every state
            # change, and CORS for the stack's own UI only.
            PREFECT_SERVER_API_AUTH_STRING=read_prefect_auth(ensure_secret_file(prefect_auth_path(self.home),
                                                                           "the Prefect API's auth string")),
            PREFECT_SERVER_CSRF_PROTECTION_ENABLED="true",
            PREFECT_SERVER_CORS_ALLOWED_ORIGINS=f"http://{HOST}:{port}",
            DO_NOT_TRACK="1",
        )
        cmd = [_executable("prefect"), "server", "start", "--host", HOST, "--port", str(port)]
        return cmd, env

    def _ray_command(self, port: int) -> tuple[list[str], dict[str, str]]:
        private_temp_dir(ray_temp_dir(self.home).parent)
        temp = ray_temp_dir(self.home)
        auth = self.config.ray_auth
        env = _env_without(_RAY_DROP)
        env.update(RAY_AUTH_MODE=auth, RAY_USAGE_STATS_ENABLED="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
                   DO_NOT_TRACK="1", **_RAY_LOOPBACK, **_RAY_NO_PRESTART)  # fmt: skip
        if auth == "token":
            env["RAY_AUTH_TOKEN_PATH"] = str(ensure_secret_file(token_path(self.home)))
        cmd = [
            _executable("ray"), "start", "--head", "--block", f"--port={port}", f"--node-ip-address={HOST}",
            f"--num-cpus={self.num_cpus}", f"--resources={json.dumps({STAGE_RESOURCE: self.stage_slots})}",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}",
            # Every driver connects with log_to_driver=False: the log monitor would re-read the workers'
            # log files ten times a second to publish lines nobody subscribes to.
            "--include-log-monitor=false",
            # Not the shared default 10001: Ray client (ray://) connections must not reach another head.
            f"--ray-client-server-port={free_port()}",
        ]  # fmt: skip
        return cmd, env

    def _node_command(self, address: str) -> tuple[list[str], dict[str, str]]:
        private_temp_dir(ray_temp_dir(self.home).parent)
        temp = ray_temp_dir(self.home)
        env = _env_without(_RAY_DROP)
        token = self.config.join_token_file or os.environ.get("RAY_AUTH_TOKEN_PATH")
        env.update(RAY_AUTH_MODE="token" if token else "disabled", RAY_USAGE_STATS_ENABLED="0", DO_NOT_TRACK="1",
                   RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", **_RAY_LOOPBACK, **_RAY_NO_PRESTART)  # fmt: skip
        if token:
            env["RAY_AUTH_TOKEN_PATH"] = str(Path(token).expanduser().resolve())
        cmd = [sys.executable, "-m", "infra.node", "--address", address, "--num-cpus", str(self.num_cpus),
               "--resources", json.dumps({STAGE_RESOURCE: self.stage_slots}), "--temp-dir", str(temp)]
        return cmd, env

    def _wait_ready(self, name: ServiceName, record: ProcessRecord, deadline: float) -> None:
        while True:
            if not _alive(record.pid, record.start_ticks):
                if _log_has(Path(record.log), record.log_offset, b"address already in use"):
                    raise InfraError(f"{name} could not listen on port {record.port}: another process took it "
                                     f"while {name} started (log: {record.log})")  # fmt: skip
                raise InfraError(f"{name} exited while starting: {_log_tail(Path(record.log), record.log_offset)} "
                                 f"(log: {record.log})")  # fmt: skip
            if self._healthy(name, record):
                return
            if time.monotonic() > deadline:
                self._stop(record)
                self._record_path(name).unlink(missing_ok=True)
                raise InfraError(f"{name} did not become healthy within {self.config.start_timeout_s:.0f} s and "
                                 f"was stopped (log: {record.log})")  # fmt: skip
            time.sleep(0.25)

    def _stop(self, record: ProcessRecord) -> str:
        pid = record.pid
        if not _alive(pid, record.start_ticks):
            # Its PID may have been reused since, even as a session id: only processes that name our
            # Ray temp dir (gcs_server, raylet, ... of a head whose `ray start` died) are surely ours.
            if record.temp_dir:
                _kill_session(pid, marker=record.temp_dir)
            return f"was not running (stale record of pid {pid} removed)"
        started = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        how = "stopped"
        if not _wait_gone(pid, record.start_ticks, self.config.stop_timeout_s):
            how = f"killed after {self.config.stop_timeout_s:.0f} s"
        _kill_session(pid)  # SIGKILL whatever is left in the session it started
        _wait_gone(pid, record.start_ticks, 5.0)
        return f"{how} (pid {pid}, {time.monotonic() - started:.1f} s)"

    # -- state files ------------------------------------------------------------------------------

    def _record_path(self, name: ServiceName) -> Path:
        return self.home / "stack" / f"{name}.json"

    def _read_record(self, name: ServiceName) -> ProcessRecord | None:
        path = self._record_path(name)
        try:
            return ProcessRecord(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as err:
            raise InfraError(
                f"unreadable stack state {path} ({err}); remove it after checking the process"
            ) from None

    def _write_record(self, name: ServiceName, record: ProcessRecord) -> None:
        path = self._record_path(name)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(record), indent=1))
        tmp.replace(path)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """One `up` or `down` at a time per state folder (two `rlflow train` starting at once)."""
        private_state_dir(self.home)
        with open(self.home / "stack" / "lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


# -- what `rlflow train` and flow processes call -------------------------------------------------------


def ensure_stack(config: StackConfig | None = None, ray: RayConfig | None = None) -> StackInfo:
    """Start what is missing and return where everything is.

    An external Ray cluster (`ray.address`) or Prefect API (`config.prefect_api_url`) is used as given,
    and nothing is started in its place.
    """
    config = config or StackConfig()
    ray_address = ray.address if ray else None
    external = {"prefect": config.prefect_api_url, "ray": ray_address}
    wanted = tuple(name for name in SERVICES if not external[name])
    slots = ray.max_concurrent_stages if ray else None
    status = LocalStack(config, stage_slots=slots).up(wanted) if wanted else None
    record = status.ray.record if status is not None and status.ray is not None else None
    default = RayConfig.model_fields["max_concurrent_stages"].default
    if ray is not None and record is not None and slots != default and record.stage_slots != slots:
        raise InfraError(f"ray.max_concurrent_stages={slots} is not allowed: the local stack's Ray head is running "
                         f"with {record.stage_slots} stage slots, and a running head keeps them (`rlflow down` "
                         "first to change them)")
    prefect = None if config.prefect_api_url else _record(status, "prefect")
    api_url = config.prefect_api_url or prefect_api_url(_record(status, "prefect").port)
    if ray_address:
        return StackInfo(prefect_api_url=api_url, ray_address=ray_address, ui_url=api_url.removesuffix("/api"),
                         prefect_auth_path=_auth_file(prefect))  # fmt: skip
    assert status is not None
    return _stack_info(api_url, _record(status, "ray"), status.home, prefect)


def _record(status: StackStatus | None, name: ServiceName) -> ProcessRecord:
    record = getattr(status, name).record if status else None
    if record is None:
        raise InfraError(f"the local {name} service is not running; start it with `rlflow up`")
    return record


def ui_login(info: StackInfo) -> str:
    """What the UI's login page asks for, said where the UI's address is printed (never the string itself)."""
    return f" (its password: the content of {info.prefect_auth_path})" if info.prefect_auth_path else ""


def _auth_file(prefect: ProcessRecord | None) -> str | None:
    return prefect.token_file if prefect is not None and prefect.auth == "token" else None


def _stack_info(api_url: str, ray_record: ProcessRecord, home: Path, prefect: ProcessRecord | None) -> StackInfo:
    return StackInfo(
        prefect_api_url=api_url,
        ray_address=f"{HOST}:{ray_record.port}",
        ui_url=api_url.removesuffix("/api"),
        ray_auth=ray_record.auth,
        ray_token_path=str(token_path(home)) if ray_record.auth == "token" else None,
        ray_loopback=ray_record.loopback,
        prefect_auth_path=_auth_file(prefect),
    )


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    alive: bool
    head: bool
    resources: dict[str, float]

    def line(self) -> str:
        shown = ", ".join(f"{k} {v:g}" for k, v in sorted(self.resources.items())
                          if k in ("CPU", "GPU") or k == STAGE_RESOURCE)
        return (f"{self.node_id[:12]}  {self.address:15} {'alive' if self.alive else 'dead ':5}  "
                f"{'head' if self.head else 'worker':6}  {shown}")


def cluster_nodes(address: str, token_path: str | None = None) -> list[NodeInfo]:
    """The nodes of the Ray cluster at `address`, read in a subprocess (a driver of its own, so this
    process's Ray state is left alone), head first."""
    env = _env_without(_RAY_DROP)
    env.update(RAY_AUTH_MODE="token" if token_path else "disabled", **_RAY_LOOPBACK)
    if token_path:
        env["RAY_AUTH_TOKEN_PATH"] = token_path
    code = (f"import json, ray; ray.init(address={address!r}, log_to_driver=False, logging_level='ERROR'); "
            "print(json.dumps([{k: n[k] for k in ('NodeID', 'NodeManagerAddress', 'Alive', 'Resources')} "
            "for n in ray.nodes()]))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip
    if proc.returncode:
        raise InfraError(f"cannot read the nodes of the Ray cluster at {address}: {proc.stderr.strip()[-300:]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    nodes = [NodeInfo(r["NodeID"], r["NodeManagerAddress"], r["Alive"], "node:__internal_head__" in r["Resources"],
                      {k: float(v) for k, v in r["Resources"].items()}) for r in rows]  # fmt: skip
    return sorted(nodes, key=lambda n: (not n.head, not n.alive, n.node_id))


def connect_env(info: StackInfo) -> dict[str, str]:
    """The environment a flow process (or a shell) needs to use the stack.

    Also unset RAY_AUTH_TOKEN when `info.ray_auth` is set: it outranks RAY_AUTH_TOKEN_PATH.
    `apply_connect_env` does both for the current process. The Prefect API's auth string is read from its
    file into PREFECT_API_AUTH_STRING: the environment is this user's alone (unlike a command line).
    """
    env = {"PREFECT_API_URL": info.prefect_api_url, "RAY_ADDRESS": info.ray_address, "DO_NOT_TRACK": "1"}
    if info.prefect_auth_path:
        env["PREFECT_API_AUTH_STRING"] = read_prefect_auth(info.prefect_auth_path)
    if info.ray_loopback:  # else a driver turns 127.0.0.1 into the host's address and finds no GCS there
        env.update(_RAY_LOOPBACK)
    if info.ray_auth is not None:
        env["RAY_AUTH_MODE"] = info.ray_auth
    if info.ray_auth == "token" and info.ray_token_path:
        env["RAY_AUTH_TOKEN_PATH"] = info.ray_token_path
    return env


def apply_connect_env(info: StackInfo, environ: MutableMapping[str, str] | None = None) -> None:
    """Put `connect_env(info)` into this process's environment: call it before the flow runs.

    Prefect and Ray both read their settings when imported; a change made afterwards is ignored unless
    their cached copies are re-read. That is done here for whichever is already imported, as each
    does itself when it changes settings (Prefect's `refresh_global_settings_context`, Ray's
    `_enable_token_auth`). Setting the environment before importing either needs neither.
    """
    target = os.environ if environ is None else environ
    wanted = connect_env(info)
    unchanged = all(target.get(k) == v for k, v in wanted.items()) and not (
        info.ray_auth is not None and "RAY_AUTH_TOKEN" in target)
    target.update(wanted)
    if info.ray_auth is not None:
        target.pop("RAY_AUTH_TOKEN", None)
    if environ is not None or unchanged:  # unchanged: a later run in this process (nothing to re-read)
        return
    if "prefect" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
    if "ray" in sys.modules:
        _reload_ray_auth_config()
        if info.ray_loopback:
            _reload_ray_cluster_mode()


def _reload_ray_auth_config() -> None:
    import ray

    if ray.is_initialized():
        logger.warning(
            "Ray is already connected in this process; the stack's auth settings apply to new processes only"
        )
        return
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (
        ImportError,
        AttributeError,
    ) as err:  # a Ray without these internals: set the env before importing ray
        logger.warning("could not refresh Ray's auth settings (%s): set them before importing ray", err)


def _reload_ray_cluster_mode() -> None:
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER into a constant when imported; it is looked up per call."""
    try:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError) as err:
        logger.warning("could not switch Ray to single-machine mode (%s): set %s before importing ray", err,
                       ", ".join(_RAY_LOOPBACK))  # fmt: skip


# -- processes, ports, files ------------------------------------------------------------------------


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields from field 3 (state) on; the command name may contain spaces."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw.rsplit(")", 1)[1].split()


def _start_ticks(pid: int) -> int | None:
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None  # field 22: starttime


def _alive(pid: int, start_ticks: int | None) -> bool:
    """Alive and the same process: not a zombie, not a new process that reused the PID."""
    child = _SPAWNED.get(pid)
    if child is not None and child.poll() is not None:
        return False
    if not Path("/proc").is_dir():  # not Linux: existence is all we can check
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = _proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return start_ticks is None or int(fields[19]) == start_ticks


def _wait_gone(pid: int, start_ticks: int | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid, start_ticks):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _kill_session(leader: int, marker: str | None = None) -> None:
    """SIGKILL the processes of the session `leader` started (start_new_session: session id == its PID).

    Ray's workers live in process groups of their own but keep the session. Called right after our
    leader was verified and stopped: Linux does not hand out a PID that is still a session id, so while
    members remain they are ours. With `marker`, only members whose command line contains it.
    """
    if not Path("/proc").is_dir():
        if marker is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(leader, signal.SIGKILL)
        return
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _proc_stat(int(entry.name))
        if not fields or int(fields[3]) != leader or fields[0] in ("Z", "X"):  # field 6: session
            continue
        if marker is not None and marker not in _cmdline(int(entry.name)):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(entry.name), signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _prefect_health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"{prefect_api_url(port)}/health", timeout=2.0) as response:
            return bool(response.status == 200 and response.read().strip() == b"true")
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            return True
    except OSError:
        return False


def _port_taken(port: int) -> bool:
    """Something listens on the port, on any address (Ray's GCS binds to all of them)."""
    if _port_open(port):
        return True
    with socket.socket() as sock:
        # SO_REUSEADDR as the servers use it: connections left in TIME_WAIT (a server just restarted
        # on this port) do not count as taken, a listener does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def _env_without(prefixes: tuple[str, ...]) -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith(prefixes)}


def _executable(name: str) -> str:
    """The console script installed next to this Python (the venv), else on PATH."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise InfraError(f"`{name}` is not installed in this environment (pip install rlflow's dependencies)")
    return found


def ensure_secret_file(path: Path, what: str = "the Ray token") -> Path:
    """A random secret of 256 bits in a 0600 file, made once per state folder: rlflow's own Ray token
    (never ~/.ray/auth_token: that file switches other Ray heads to token auth), the Prefect API's auth string,
    the record key (infra/record_key.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if not path.read_text().strip():
            raise InfraError(f"{what} file {path} is empty; remove it and run `rlflow up` again") from None
        return path
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32))  # as `ray get-auth-token --generate`: 256 bits
    return path


def _rotate(log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    if log.exists() and log.stat().st_size > _LOG_ROTATE_BYTES:
        log.replace(log.with_suffix(".log.1"))


def _log_has(log: Path, offset: int, needle: bytes) -> bool:
    try:
        with open(log, "rb") as handle:
            handle.seek(offset)
            return needle in handle.read()
    except FileNotFoundError:
        return False


def _log_tail(log: Path, offset: int, lines: int = 3) -> str:
    try:
        with open(log, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) or "(empty log)"
