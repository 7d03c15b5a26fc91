"""Fixtures of the storage tests: every store test runs on a temp folder AND on the S3 server."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from storage_helpers import FAST, ProxyProcess

from infra.store import ObjectStore

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# The S3 half starts the S3 server: it is in the slow tier (tests/conftest.py).
@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_root(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A fresh, empty root: a temp folder, or a unique prefix in the test bucket."""
    if backend == "local":
        return str(tmp_path / "runs")
    server = request.getfixturevalue("s3_server")
    request.getfixturevalue("s3_env")
    return f"s3://{server.bucket}/{uuid.uuid4().hex[:10]}"


@pytest.fixture
def store(store_root: str) -> ObjectStore:
    return ObjectStore(store_root, **FAST)


@pytest.fixture
def s3_proxy(s3_server, s3_env) -> Iterator[ProxyProcess]:
    proxy = ProxyProcess(s3_server.port)
    try:
        yield proxy
    finally:
        if proxy.proc is not None and proxy.proc.poll() is None:
            os.kill(proxy.proc.pid, signal.SIGCONT)  # in case a test froze it
        proxy.kill()
