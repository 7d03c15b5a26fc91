"""The local stack: records, stale PIDs, environment; then a real Prefect server + Ray head (integration)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.commands import stack as stack_cmd
from infra.config import StackConfig
from infra.errors import InfraError
from infra.stack import (
    STAGE_RESOURCE,
    LocalStack,
    ProcessRecord,
    StackInfo,
    connect_env,
    prefect_auth_path,
    ray_temp_dir,
    read_prefect_auth,
    resolve_home,
)

HERE = Path(__file__).resolve().parent


def quiet_port() -> int:
    """A free port below the ephemeral range: one from that range may be taken by any outgoing
    connection while the Prefect server boots (seen on the shared dev machine)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError):
        low = 32768
    for _ in range(200):
        port = random.randrange(20000, low)
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port")


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlflow")
    stack_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def session_members(leader: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == leader and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def write_record(home: Path, name: str, record: ProcessRecord) -> None:
    (home / "stack").mkdir(parents=True, exist_ok=True)
    (home / "stack" / f"{name}.json").write_text(json.dumps(record.__dict__))


# -- without services -------------------------------------------------------------------------------


def test_home_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RLFLOW_HOME", str(tmp_path / "h"))
    assert resolve_home() == tmp_path / "h"
    assert resolve_home(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("RLFLOW_HOME")
    assert resolve_home() == Path("~/.rlflow").expanduser().resolve()


def test_ray_temp_dir_fits_socket_paths(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    # Ray's longest socket path below its temp dir: session_<date>_<time>_<us>_<pid>/sockets/plasma_store
    longest = ray_temp_dir(deep) / "session_2026-11-29_18-27-21_700806_4194304" / "sockets" / "plasma_store"
    assert len(str(longest).encode()) <= 107
    assert ray_temp_dir(deep) == ray_temp_dir(deep) != ray_temp_dir(tmp_path)


def test_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    stack = LocalStack(StackConfig(home=str(tmp_path)))
    status = stack.status()
    assert (status.prefect.state, status.ray.state, status.running) == ("stopped", "stopped", False)
    assert stack.down() == ["prefect: not running", "ray: not running"]
    with pytest.raises(InfraError, match="rlflow up"):
        status.info()
    monkeypatch.setenv("RLFLOW_HOME", str(tmp_path))
    assert run_cli(["down"]) == 0
    assert "nothing is running" in capsys.readouterr().out
    assert run_cli(["status"]) == 1
    assert "prefect  stopped" in capsys.readouterr().out


def test_stale_records_are_detected_and_cleared(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    now = time.time()
    write_record(tmp_path, "prefect", ProcessRecord(gone.pid, None, 1, "p.log", 0, now))
    # A live PID with another start time: the PID was reused by a process that is not ours.
    write_record(tmp_path, "ray", ProcessRecord(os.getpid(), 1, 2, "r.log", 0, now, auth="token"))
    stack = LocalStack(StackConfig(home=str(tmp_path)))
    status = stack.status()
    assert (status.prefect.state, status.ray.state) == ("stale", "stale")
    assert "stale" in status.prefect.detail
    lines = stack.down()  # must not signal the test process that now owns the PID
    assert all("was not running" in line for line in lines), lines
    assert stack.status().prefect.state == stack.status().ray.state == "stopped"


def test_stale_ray_leftovers_are_killed_and_nothing_else(tmp_path: Path) -> None:
    """A head whose `ray start` died leaves its GCS and raylet: they name our temp dir and go; other
    processes of that session id (it may be a reused PID's by now) are left alone."""
    marker = str(tmp_path / "rlflow-ray-test")
    sleeper = "import time; time.sleep(60)"
    leader = subprocess.Popen(
        ["sh", "-c", f'"{sys.executable}" -c "{sleeper}" {marker} & "{sys.executable}" -c "{sleeper}" other & wait'],
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while len(session_members(leader.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    children = [pid for pid in session_members(leader.pid) if pid != leader.pid]
    assert len(children) == 2
    os.kill(leader.pid, 9)
    leader.wait()
    write_record(
        tmp_path, "ray", ProcessRecord(leader.pid, None, 1, "r.log", 0, time.time(), temp_dir=marker)
    )
    try:
        assert LocalStack(StackConfig(home=str(tmp_path))).down()[1].startswith("ray: was not running")
        time.sleep(0.5)
        left = session_members(leader.pid)
        assert len(left) == 1 and "other" in Path(f"/proc/{left[0]}/cmdline").read_text()
    finally:
        for pid in session_members(leader.pid):
            os.kill(pid, 9)


def test_busy_port_is_refused_before_starting(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        stack = LocalStack(StackConfig(home=str(tmp_path), prefect_port=port))
        with pytest.raises(InfraError, match=f"port {port}.*--prefect-port"):
            stack.up(("prefect",))
    assert stack.status().prefect.state == "stopped"


def test_connect_env() -> None:
    token = StackInfo(
        "http://127.0.0.1:4200/api", "127.0.0.1:6379", "http://127.0.0.1:4200", "token", "/h/tok"
    )
    assert connect_env(token) == {
        "PREFECT_API_URL": "http://127.0.0.1:4200/api",
        "RAY_ADDRESS": "127.0.0.1:6379",
        "DO_NOT_TRACK": "1",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": "/h/tok",
    }
    disabled = StackInfo("u/api", "a:1", "u", "disabled")
    assert connect_env(disabled)["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN_PATH" not in connect_env(
        disabled
    )
    external = StackInfo("u/api", "ray.example:6379", "u")  # a cluster of the user's: its auth is theirs
    assert not any(key.startswith("RAY_AUTH") for key in connect_env(external))
    assert "PREFECT_API_AUTH_STRING" not in connect_env(external)  # an external Prefect API: the user's env

    # Our head in Ray's single-machine mode (the node IP stays 127.0.0.1): its clients need the mode too.
    loopback = StackInfo("u/api", "127.0.0.1:6379", "u", "token", "/h/tok", ray_loopback=True)
    assert connect_env(loopback)["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in connect_env(token) | connect_env(external)


def test_connect_env_reads_the_prefect_auth_string(tmp_path: Path) -> None:
    """Our Prefect server's auth string reaches a client through its environment, read from the 0600 file;
    a missing or empty file is one line, not a client that fails later with 401."""
    (tmp_path / "auth").write_text("s3cret-string\n")
    ours = StackInfo("u/api", "a:1", "u", "token", "/h/tok", prefect_auth_path=str(tmp_path / "auth"))
    assert connect_env(ours)["PREFECT_API_AUTH_STRING"] == "s3cret-string"
    (tmp_path / "auth").write_text("")
    with pytest.raises(InfraError, match="auth string file .*auth is empty"):
        connect_env(ours)
    with pytest.raises(InfraError, match="cannot read the Prefect API's auth string .*missing"):
        connect_env(StackInfo("u/api", "a:1", "u", prefect_auth_path=str(tmp_path / "missing")))


def test_prefect_command_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server is locked (an auth string made once, 0600; CSRF; CORS for its own UI) and takes none of
    the caller's Prefect auth or CSRF settings."""
    monkeypatch.setenv("PREFECT_SERVER_API_AUTH_STRING", "someone-elses")
    monkeypatch.setenv("PREFECT_SERVER_CSRF_PROTECTION_ENABLED", "false")
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "someone-elses")
    stack = LocalStack(StackConfig(home=str(tmp_path)))
    _, env = stack._prefect_command(4321)
    auth = prefect_auth_path(stack.home)
    assert env["PREFECT_SERVER_API_AUTH_STRING"] == read_prefect_auth(auth) != "someone-elses"
    assert auth.stat().st_mode & 0o777 == 0o600 and len(read_prefect_auth(auth)) == 64
    assert env["PREFECT_SERVER_CSRF_PROTECTION_ENABLED"] == "true" and "PREFECT_API_AUTH_STRING" not in env
    assert env["PREFECT_SERVER_CORS_ALLOWED_ORIGINS"] == "http://127.0.0.1:4321"
    assert stack._prefect_command(4321)[1]["PREFECT_SERVER_API_AUTH_STRING"] == read_prefect_auth(auth)  # kept


def test_ray_command_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN", "someone-elses")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    stack = LocalStack(StackConfig(home=str(tmp_path), num_cpus=3), stage_slots=2)
    cmd, env = stack._ray_command(6379)
    assert env["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in env and "RAY_ADDRESS" not in env
    token = Path(env["RAY_AUTH_TOKEN_PATH"])
    assert token.parent == tmp_path / "stack" and oct(token.stat().st_mode & 0o777) == "0o600"
    assert len(token.read_text()) == 64
    assert "--num-cpus=3" in cmd and f'--resources={{"{STAGE_RESOURCE}": 2}}' in cmd
    # No log monitor and no idle workers prestarted for the first driver (infra/stack.py), on the head
    # and on a node that joins it (infra.node passes its environment to the raylet).
    assert "--include-log-monitor=false" in cmd and env["RAY_prestart_worker_first_driver"] == "0"
    assert stack._node_command("127.0.0.1:6379")[1]["RAY_prestart_worker_first_driver"] == "0"
    _, env = LocalStack(StackConfig(home=str(tmp_path), ray_auth="disabled"))._ray_command(6379)
    assert env["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN_PATH" not in env


# -- with services ----------------------------------------------------------------------------------


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    home = tmp_path_factory.mktemp("stack")
    home.chmod(0o755)  # as `mkdir` leaves it: `up` makes it private
    config = StackConfig(home=str(home), prefect_port=quiet_port(), ray_port=quiet_port())
    stack = LocalStack(config)
    try:
        yield stack
    finally:
        stack.down()
        shutil.rmtree(ray_temp_dir(stack.home), ignore_errors=True)


@pytest.mark.integration
@pytest.mark.slow
def test_up_flow_down(
    stack: LocalStack, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    status = stack.up()
    assert status.running, status
    assert "started" in status.prefect.detail and "started" in status.ray.detail
    info = status.info()
    assert info.ui_url == f"http://127.0.0.1:{stack.config.prefect_port}"
    assert info.ray_address == f"127.0.0.1:{stack.config.ray_port}" and info.ray_auth == "token"
    pids = {status.prefect.pid, status.ray.pid}

    again = stack.up()  # idempotent: the same processes, reported as such
    assert {again.prefect.pid, again.ray.pid} == pids
    assert again.prefect.detail == again.ray.detail == "already running"

    monkeypatch.setenv("RLFLOW_HOME", str(stack.home))
    assert run_cli(["status"]) == 0
    out = capsys.readouterr().out
    assert info.ui_url in out and info.ray_address in out and all(str(pid) in out for pid in pids)
    auth = prefect_auth_path(stack.home)  # the API's credential: where it is, never what it is
    assert info.prefect_auth_path == str(auth) and auth.stat().st_mode & 0o777 == 0o600
    assert f"auth string in {auth} (the UI asks for it)" in out and read_prefect_auth(auth) not in out
    assert run_cli(["status", "--env"]) == 0
    out = capsys.readouterr().out
    assert f'export PREFECT_API_AUTH_STRING="$(cat {auth})"' in out.splitlines() and read_prefect_auth(auth) not in out

    probe = subprocess.run(
        [sys.executable, str(HERE / "flow_probe.py"), str(stack.home)],
        capture_output=True, text=True, timeout=240,
        env={k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "RAY_"))},
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["api_url"] == info.prefect_api_url  # reached the Ray worker without any env var there
    # ...and so did the auth string: the worker's own call to the API passed
    assert result["api_auth_sha256"] == hashlib.sha256(read_prefect_auth(auth).encode()).hexdigest()
    assert result["worker_read_runs"] == 1 and result["env_has_auth"] is False
    assert result["resources"] == {STAGE_RESOURCE: 1.0}  # num_cpus=0: no CPU taken
    assert result["flow_state"] == result["server_state"] == "COMPLETED"
    assert result["actor_pid"] == result["actor_pid_before"] == result["actor_pid_after"]
    # After a driver connected and a flow ran: on c4b7975 the state folder was 0755, prefect.db 0644 and Ray's
    # temp folder 0777 (Ray makes the folder it is given world-writable; now the folder above it is ours).
    for folder in (stack.home, stack.home / "stack", stack.home / "prefect", ray_temp_dir(stack.home).parent):
        assert (folder.stat().st_mode & 0o777, folder.lstat().st_uid) == (0o700, os.getuid()), folder
    for name in ("prefect/prefect.db", "stack/prefect.log", "stack/ray.log", "stack/prefect_auth", "stack/ray_auth_token"):
        assert (stack.home / name).stat().st_mode & 0o777 == 0o600, name

    leaders = [pid for pid in pids if pid is not None]
    lines = stack.down()
    assert all(": stopped (pid" in line for line in lines), lines
    assert not any(session_members(pid) for pid in leaders)  # the head's workers too
    after = stack.status()
    assert (after.prefect.state, after.ray.state) == ("stopped", "stopped")
    assert stack.down() == ["prefect: not running", "ray: not running"]


def test_a_credentials_file_lives_as_long_as_its_process(tmp_path: Path) -> None:
    """flows/train.credentials_file: 0600 in a 0700 folder of the stack's state folder while the process
    that wrote it runs; gone when it exits (and `rlflow down` removes the folder: a killed process)."""
    code = ("import sys; from flows.train import credentials_file\n"
            "p = credentials_file('AKIDEXAMPLE', 'planted-secret', None)\n"
            "print(p, oct(p.stat().st_mode & 0o777), oct(p.parent.stat().st_mode & 0o777), flush=True)\n"
            "print('planted-secret' in p.read_text())\n")
    env = {**os.environ, "RLFLOW_HOME": str(tmp_path / "home"), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    path, mode, folder_mode, holds = out.split()
    assert (mode, folder_mode, holds) == ("0o600", "0o700", "True")
    assert Path(path).parent == tmp_path / "home" / "credentials" and not Path(path).exists()

    from infra.config import StackConfig
    from infra.stack import LocalStack

    left = tmp_path / "home" / "credentials" / "killed-run.ini"  # what a SIGKILLed run leaves
    left.write_text("[rlflow]\n")
    LocalStack(StackConfig(home=str(tmp_path / "home"))).down()
    assert not left.parent.exists()


def test_rays_temp_folder_is_private(tmp_path: Path) -> None:
    """Ray's sockets and logs live in /tmp/rlflow-ray-<hash>, which anyone can make first: made 0700,
    tightened when ours and open, refused when it is another user's or a link."""
    from infra.stack import private_temp_dir

    made = private_temp_dir(tmp_path / "made")
    assert made.stat().st_mode & 0o777 == 0o700
    (tmp_path / "open").mkdir(mode=0o777)
    (tmp_path / "open").chmod(0o777)
    assert private_temp_dir(tmp_path / "open").stat().st_mode & 0o777 == 0o700
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(InfraError, match="is not a folder"):
        private_temp_dir(tmp_path / "link")
    if os.getuid() != 0:
        pytest.skip("making a folder another user owns needs root")
    (tmp_path / "theirs").mkdir(mode=0o700)
    os.chown(tmp_path / "theirs", 65534, 65534)
    with pytest.raises(InfraError, match=r"belongs to uid 65534, not to you \(uid 0\): someone else made it first"):
        private_temp_dir(tmp_path / "theirs")
