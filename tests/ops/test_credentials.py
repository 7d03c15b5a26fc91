"""Credentials and exposure: a real two-iteration run on S3 whose secret key is planted (unique to this
session, given only as AWS_SECRET_ACCESS_KEY in the CLI's environment) and then looked for
everywhere rlflow, Prefect and Ray keep things: the CLI output, the Prefect API (flow-run parameters,
states, task runs, artifacts, logs), Prefect's persisted results, run.json and every object of the run
in storage, the metric loggers' files, and the stack's logs and database; the Prefect API's auth string
is looked for there too. And the local stack listens on 127.0.0.1 only, and its Prefect API answers
nothing without the stack's auth string, nor a state change without a CSRF token.

The S3 server here is the dev server (`infra.s3server`) started with the planted key pair, so the
secret is a value nothing else in the session uses. (The code-reward sandbox's timeout and memory cap
are tested in tests/rewards/test_sandbox.py.)
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.services import REPO, Cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REWARD = f"reward.function={REPO / 'tests' / 'pipeline' / 'rewards.py'}:digit_share"
RUN_ID = "planted-secret"


@dataclass(frozen=True)
class PlantedS3:
    endpoint_url: str
    bucket: str
    key_id: str
    secret: str


@pytest.fixture(scope="module")
def planted_s3() -> Iterator[PlantedS3]:
    """The dev S3 server accepting only a key pair made up for this session."""
    key_id = "AKIA" + uuid.uuid4().hex[:16].upper()
    secret = "planted-" + uuid.uuid4().hex + uuid.uuid4().hex[:8]
    proc = subprocess.Popen(
        [sys.executable, "-m", "infra.s3server", "--port", "0", "--bucket", "planted", "--access-key-id", key_id,
         "--secret-access-key", secret],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("endpoint "), line
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # never let the pipe fill
        yield PlantedS3(line.split()[1], "planted", key_id, secret)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(15)


@dataclass(frozen=True)
class Trained:
    proc: subprocess.CompletedProcess[str]
    prefect_home: Path  # the flow process's (and its Ray workers') PREFECT_HOME: persisted results
    log_dir: Path  # the metric loggers' files


@pytest.fixture(scope="module")
def trained(cli: Cli, tiny_model_dir: Path, planted_s3: PlantedS3, tmp_path_factory: pytest.TempPathFactory
            ) -> Trained:
    prefect_home = tmp_path_factory.mktemp("prefect-client")
    log_dir = tmp_path_factory.mktemp("logger-files")
    env = {k: v for k, v in cli.env.items() if not k.startswith("AWS_")}
    env["AWS_SECRET_ACCESS_KEY"] = planted_s3.secret  # the only source of the secret (never a command line)
    env["PREFECT_HOME"] = str(prefect_home)
    proc = Cli(env)(
        "train", f"model.path={tiny_model_dir}", f"storage.root=s3://{planted_s3.bucket}/runs",
        f"storage.endpoint_url={planted_s3.endpoint_url}", f"storage.access_key_id={planted_s3.key_id}",
        f"trainer.run_id={RUN_ID}", REWARD,
        "trainer.total_iterations=2", "trainer.save_every=1", "trainer.val_every=2", "data.train_size=64",
        "data.train_batch_size=8", "actor.mini_batch_size=32", "actor.micro_batch_size=32", "data.val_size=8", "rollout.max_new_tokens=8", "trainer.loggers=[tensorboard]", f"trainer.log_dir={log_dir}",
        "--log-level", "DEBUG",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Trained(proc, prefect_home, log_dir / RUN_ID)


def files_under(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            yield path


def leaks(secret: str, named: dict[str, bytes]) -> list[str]:
    """Where `secret` occurs: each name with the text around its first occurrence (the secret masked)."""
    needle = secret.encode()
    found = []
    for name, data in named.items():
        at = data.find(needle)
        if at >= 0:
            around = data[max(0, at - 160):at + len(needle) + 40].replace(needle, b"<SECRET>")
            found.append(f"{name}: ...{around.decode(errors='replace')}...")
    return found


def test_secret_not_in_cli_output(trained: Trained, planted_s3: PlantedS3) -> None:
    out = trained.proc.stdout + trained.proc.stderr
    assert f"run {RUN_ID} finished iteration 2" in out
    assert planted_s3.secret not in out


def test_secret_not_in_storage(trained: Trained, planted_s3: PlantedS3) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(key=planted_s3.key_id, secret=planted_s3.secret, endpoint_url=planted_s3.endpoint_url)
    base = f"{planted_s3.bucket}/runs/{RUN_ID}"
    objects = {path: bytes(fs.cat_file(path)) for path in fs.find(base)}
    names = {p.removeprefix(base + "/") for p in objects}
    assert {"run.json", "lock.json", "checkpoints/LATEST", "metrics/iter_000002.json",
            "buffers/iter_000002/advantage.parquet"} <= names, sorted(names)
    assert any(n.startswith("export/") for n in names) and any(n.endswith("MANIFEST.json") for n in names)
    info = json.loads(objects[f"{base}/run.json"])
    assert info["config"]["storage"]["endpoint_url"] == planted_s3.endpoint_url  # the snapshot is there...
    assert "secret_access_key" not in info["config"]["storage"]  # ...without the credentials
    assert leaks(planted_s3.secret, objects) == []


def paged(read: Callable[[int], list[Any]]) -> list[Any]:
    found: list[Any] = []
    while page := read(len(found)):
        found += page
    return found


def prefect_dump(client: Any) -> dict[str, bytes]:
    """Everything the stack's Prefect API holds, as JSON: flow runs (parameters, states), task runs,
    artifacts and logs."""
    groups = {
        "flow_runs": paged(lambda n: client.read_flow_runs(limit=200, offset=n)),
        "task_runs": paged(lambda n: client.read_task_runs(limit=200, offset=n)),
        "artifacts": paged(lambda n: client.read_artifacts(limit=200, offset=n)),
        "logs": paged(lambda n: client.read_logs(limit=200, offset=n)),
    }
    return {name: ("[" + ",".join(item.model_dump_json() for item in items) + "]").encode()
            for name, items in groups.items()}


@pytest.mark.effect_of("trainer.run_id")
def test_secret_not_in_prefect(trained: Trained, planted_s3: PlantedS3, prefect: Any) -> None:
    """`prefect`: a client of the stack's API (tests/ops/conftest.py)."""
    dump = prefect_dump(prefect)
    runs = json.loads(dump["flow_runs"])
    mine = [r for r in runs if r["name"] == RUN_ID]
    assert len(mine) == 1 and mine[0]["state"]["type"] == "COMPLETED"
    overrides = mine[0]["parameters"]["overrides"]
    assert f"storage.endpoint_url={planted_s3.endpoint_url}" in overrides  # the parameters are all there...
    assert not any(o.startswith(("storage.access_key_id", "storage.secret_access_key")) for o in overrides)
    assert any(r["name"] == "iter-000002" for r in runs)
    assert RUN_ID.encode() in dump["artifacts"] and b"iter 2: reward" in dump["logs"]
    assert leaks(planted_s3.secret, dump) == []  # ...and the secret is nowhere in them


@pytest.mark.effect_of("trainer.loggers")
def test_secret_not_in_persisted_results_or_logger_files(trained: Trained, planted_s3: PlantedS3) -> None:
    results = {str(p): p.read_bytes() for p in files_under(trained.prefect_home)}
    assert any("/storage/" in name for name in results), "no persisted Prefect results to look in"
    loggers = {str(p): p.read_bytes() for p in files_under(trained.log_dir)}
    assert loggers, "the tensorboard logger wrote nothing"
    assert leaks(planted_s3.secret, results | loggers) == []


def test_secret_not_in_stack_logs_or_database(trained: Trained, planted_s3: PlantedS3, stack_home: Path) -> None:
    from infra.stack import ray_temp_dir

    files = {str(p): p.read_bytes() for folder in (stack_home, ray_temp_dir(stack_home)) for p in files_under(folder)}
    assert any(name.endswith("prefect.db") for name in files) and any(name.endswith("ray.log") for name in files)
    assert any("/logs/" in name and "raylet" in name for name in files), "no Ray session logs to look in"
    # The workers' AWS credentials file (0600, in a 0700 folder: tests/test_internals.py) was removed when
    # the run's process exited: the secret is in no file of the stack, that folder included.
    vault = stack_home / "credentials"
    assert any(name.startswith(str(vault)) for name in files) is False, [n for n in files if str(vault) in n]
    assert leaks(planted_s3.secret, files) == []
    assert vault.stat().st_mode & 0o777 == 0o700
    # The Prefect API's auth string is in its own 0600 file and nowhere else: not in the server's log, the
    # database, Ray's logs (the runtime environments the workers got), nor the run's output.
    from infra.stack import prefect_auth_path, read_prefect_auth

    auth_file = prefect_auth_path(stack_home)
    auth = read_prefect_auth(auth_file)
    assert auth_file.stat().st_mode & 0o777 == 0o600 and str(auth_file) in files
    assert leaks(auth, {name: data for name, data in files.items() if name != str(auth_file)}) == []
    assert auth not in trained.proc.stdout + trained.proc.stderr


# ----------------------------------------------------------------------------------- binding

# 127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net/tcp{,6} write them (hex, host byte order per word).
_LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def _session_pids(leader: int) -> list[int]:
    """Every live process in the session `leader` started (the stack starts each service in its own)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) == leader:  # field 6, the session id
                pids.append(int(entry.name))
    return pids


def _listening() -> dict[str, str]:
    """inode -> "address:port" (hex, as the kernel writes it) of every listening TCP socket."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A":  # LISTEN
                found[cols[9]] = cols[1]
    return found


def _readable(hex_address: str) -> str:
    address, port = hex_address.split(":")
    if len(address) == 8:
        host = ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0))
    else:
        host = "::" if set(address) == {"0"} else f"[{address}]"
    return f"{host}:{int(port, 16)}"


def stack_listeners(stack_home: Path) -> list[tuple[str, str, str]]:
    """(service, process name, hex address:port) of every listening socket of the stack's processes."""
    return [(service, name, address) for service, _, name, address in _stack_sockets(stack_home)]


def _stack_sockets(stack_home: Path) -> list[tuple[str, int, str, str]]:
    """(service, pid, process name, hex address:port) of every listening socket of the stack's processes."""
    listening = _listening()
    found = []
    for service in ("prefect", "ray"):
        record = json.loads((stack_home / "stack" / f"{service}.json").read_text())
        for pid in _session_pids(record["pid"]):
            try:
                fds = list(Path(f"/proc/{pid}/fd").iterdir())
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:  # it ended
                continue
            links = []
            for fd in fds:
                with contextlib.suppress(OSError):  # closed meanwhile: one fd, not the whole process
                    links.append(os.readlink(fd))
            inodes = {link[8:-1] for link in links if link.startswith("socket:[")}
            found += [(service, pid, name, listening[i]) for i in sorted(inodes & listening.keys())]
    return found


def test_prefect_server_binds_loopback_only(stack_home: Path) -> None:
    found = [(name, a) for service, name, a in stack_listeners(stack_home) if service == "prefect"]
    assert found, "the Prefect server listens nowhere?"
    assert [f"{name} {_readable(a)}" for name, a in found if a.split(":")[0] not in _LOOPBACK] == []


def _prefect_call(url: str, method: str = "GET", headers: dict[str, str] | None = None,
                  body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _basic(secret: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(secret.encode()).decode()}


def test_the_prefect_api_requires_the_stacks_auth_string(stack_home: Path, api_url: str) -> None:
    """Any local process drove the API with no credential on main (a read and a state change answered
    200): now every request but the health probes needs the stack's auth string (401 without it or with
    another), the UI's own API included; Prefect's client, given it, works."""
    from prefect import get_client
    from prefect.settings import temporary_settings

    from infra.stack import prefect_auth_path, read_prefect_auth
    from tests.ops.conftest import api_settings

    auth = read_prefect_auth(prefect_auth_path(stack_home))
    assert len(auth) >= 32
    assert _prefect_call(f"{api_url}/health")[0] == 200  # the probes stay open (stack health, k8s)
    for headers in ({}, _basic("not-" + auth), {"Authorization": f"Bearer {auth}"}):
        status, _, body = _prefect_call(f"{api_url}/admin/version", headers=headers)
        assert (status, json.loads(body)) == (401, {"exception_message": "Unauthorized"}), headers.keys()
        status, _, body = _prefect_call(f"{api_url}/flow_runs/filter", "POST", headers, b"{}")
        assert status in (401, 403), (status, body[:200])
    assert _prefect_call(f"{api_url}/admin/version", headers=_basic(auth))[0] == 200
    with temporary_settings(updates=api_settings(api_url, stack_home)), get_client(sync_client=True) as client:
        assert isinstance(client.read_flow_runs(limit=1), list)  # a POST: auth string and CSRF token


def test_a_page_in_another_origin_cannot_drive_the_prefect_api(stack_home: Path, api_url: str) -> None:
    """CSRF protection and CORS limited to the stack's own UI, behind the auth string: a state change
    without a CSRF token is refused even with the credential, and a page of another origin gets no CORS
    grant to read a token; the UI's own origin is granted."""
    from infra.stack import prefect_auth_path, read_prefect_auth

    auth = _basic(read_prefect_auth(prefect_auth_path(stack_home)))
    own, evil = api_url.removesuffix("/api"), "http://evil.example"
    status, _, body = _prefect_call(f"{api_url}/flow_runs/filter", "POST", {"Origin": evil, **auth}, b"{}")
    assert (status, json.loads(body)) == (403, {"detail": "Missing CSRF token."})
    _, headers, _ = _prefect_call(f"{api_url}/csrf-token?client=evil", headers={"Origin": evil, **auth})
    assert headers.get("access-control-allow-origin") not in (evil, "*")
    status, headers, body = _prefect_call(f"{api_url}/csrf-token?client=ui", headers={"Origin": own, **auth})
    assert status == 200 and headers.get("access-control-allow-origin") == own
    token = json.loads(body)["token"]
    status, _, _ = _prefect_call(f"{api_url}/flow_runs/filter", "POST",
                                 {"Origin": own, "Prefect-Csrf-Token": token, "Prefect-Csrf-Client": "ui", **auth},
                                 b"{}")  # fmt: skip
    assert status == 200  # the token the UI's origin fetched passes


# A client of the stack with an actor, so that Ray's workers run too while the sockets are read.
_ACTOR_CLIENT = """
import os, sys
from infra.stack import LocalStack, apply_connect_env
from infra.config import StackConfig
apply_connect_env(LocalStack(StackConfig(home=sys.argv[1])).status().info())
import ray
ray.init(namespace="loopback-probe", log_to_driver=False)
@ray.remote(num_cpus=0)
class Probe:
    def pid(self):
        return os.getpid()
print(ray.get(Probe.remote().pid.remote()), flush=True)
sys.stdin.read()
"""


def test_ray_head_binds_loopback_only(stack_home: Path) -> None:
    client = subprocess.Popen([sys.executable, "-c", _ACTOR_CLIENT, str(stack_home)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        actor_pid = int(client.stdout.readline() or 0)  # type: ignore[union-attr]
        assert actor_pid, "the probe client could not start its actor"
        sockets = [(pid, name, a) for service, pid, name, a in _stack_sockets(stack_home) if service == "ray"]
        assert {"gcs_server", "raylet"} <= {name for _, name, _ in sockets}
        found = [(name, a) for _, name, a in sockets]
        exposed = [f"{name} {_readable(a)}" for name, a in found if a.split(":")[0] not in _LOOPBACK]
        assert exposed == [], f"the Ray head listens beyond loopback: {exposed}"
    finally:
        client.stdin.close()  # type: ignore[union-attr]
        client.wait(timeout=60)
