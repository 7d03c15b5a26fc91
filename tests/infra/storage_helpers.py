"""Helpers of the storage tests (imported by conftest and the tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Short waits so the suite stays fast; the fault tests set their own.
FAST = dict(retry_attempts=4, retry_max_wait_s=0.5, connect_timeout_s=2.0, read_timeout_s=10.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProxyProcess:
    """tcp_proxy.py as a subprocess that a test can kill, restart on the same port, or freeze."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.up = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *extra: str) -> None:
        for _ in range(50):  # the port may still be held for a moment after a kill
            proc = subprocess.Popen([sys.executable, str(HERE / "tcp_proxy.py"), str(self.port),
                                     str(self.target_port), *extra],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            if proc.stdout.readline().strip() == "ready":
                self.proc = proc
                self.up = 0
                threading.Thread(target=self._read, args=(proc,), daemon=True).start()
                return
            proc.wait()
            time.sleep(0.1)
        raise RuntimeError(f"tcp proxy could not listen on {self.port}")

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("up "):
                self.up = int(line.split()[1])

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def wait_for_upload(self, at_least: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.up < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.up} bytes went through the proxy")
            time.sleep(0.02)
