"""Real services for integration tests, started as subprocesses and stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def quiet_port() -> int:
    """A free port below the ephemeral range, so no outgoing connection takes it while a slow server
    (Prefect boots in ~10-30 s) is still starting on it."""
    import random

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


REPO = Path(__file__).resolve().parent.parent


class Cli:
    """`rlflow ...` as a user runs it, in a subprocess, against the test stack."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __call__(self, *args: str, timeout: float = 600, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout, check=False)

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO,
                                env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


@contextmanager
def ray_head(num_cpus: int = 4, stage_slots: int = 4) -> Iterator[str]:
    """A Ray head node (`ray start --head --block`) in its own temp dir; yields its address.

    `--block` keeps `ray start` in the foreground; SIGTERM to it stops every process it started.
    The temp dir is short because Ray's socket paths must fit in 107 bytes.
    """
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rlr", dir="/tmp")
    # Explicit: with ~/.ray/auth_token present, `ray start` would turn token auth on by itself.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    cmd = [_ray_bin(), "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
           "--include-dashboard=false", f"--temp-dir={temp}", f'--resources={{"rlflow_stage": {stage_slots}}}',
           "--disable-usage-stats"]
    log = open(Path(temp) / "head.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        _wait_port(port, proc, Path(temp) / "head.log")
        yield address
    finally:
        _stop(proc)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray head exited: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                time.sleep(2.0)  # GCS is up; give the raylet a moment to register
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"ray head did not listen on {port}: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
