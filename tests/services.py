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


class WarmCli:
    """`rlflow ...` run in one long-lived process (tests/warm_cli.py) instead of one process per command:
    what a command does and prints is the same (the same `flows.cli.main`, its output and exit code
    returned as `Cli` returns them), and the process's Ray job keeps its stage workers from run to run.

    For runs and their assertions, not for what is about the process itself: a run that kills its own
    process (`debug.kill_flow_after`), Ctrl-C, and the first part of a run whose resume must start from
    storage alone (run that part with `Cli`, in its own process: the resume here never saw it).
    `rlflow engine list|stop` here uses the process's Ray connection when a run made one (else joins and
    leaves again: flows/commands/engine.connect), ~0.5 s instead of a process of its own (~3 CPU s)."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.env, self.folder = env, folder
        self.proc: subprocess.Popen[str] | None = None
        self.count = 0

    def __call__(self, *args: str, timeout: float = 600, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess[str]:
        import json
        import threading

        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "warm_cli.py")], cwd=REPO,
                                         env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.count += 1
        out = self.folder / f"command-{self.count:03d}"
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"argv": list(args), "env": env or {}, "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        timer = threading.Timer(timeout, self.proc.kill)  # a hung command fails its test, not the session
        timer.start()
        try:
            answer = self.proc.stdout.readline()
        finally:
            timer.cancel()
        stdout = Path(f"{out}.stdout").read_text() if Path(f"{out}.stdout").exists() else ""
        stderr = Path(f"{out}.stderr").read_text() if Path(f"{out}.stderr").exists() else ""
        if not answer:
            code = self.proc.wait()
            self.proc = None
            raise AssertionError(f"the warm CLI process ended ({code}) during `rlflow {' '.join(args)}`:\n"
                                 f"{stderr[-4000:]}")
        return subprocess.CompletedProcess(["rlflow", *args], json.loads(answer)["rc"], stdout, stderr)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
    # No idle workers prestarted for the first driver (infra/stack.py says why).
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_prestart_worker_first_driver": "0"}
    cmd = [_ray_bin(), "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
           "--include-dashboard=false", f"--temp-dir={temp}", f'--resources={{"rlflow_stage": {stage_slots}}}',
           "--disable-usage-stats", "--include-log-monitor=false"]  # drivers here use log_to_driver=False
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
