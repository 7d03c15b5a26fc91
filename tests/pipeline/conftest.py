from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def stack_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real local stack (Prefect server + Ray head) in its own state folder, on free ports."""
    from infra.config import StackConfig
    from infra.stack import LocalStack

    home = tmp_path_factory.mktemp("stack")
    stack = LocalStack(StackConfig(home=str(home), prefect_port=free_port(), ray_port=free_port()))
    stack.up()
    try:
        yield home
    finally:
        stack.down()


class Cli:
    """`rlflow ...` as a user runs it, in a subprocess, against the test stack."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def cli(stack_home: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Cli:
    env = {**os.environ, "RLFLOW_HOME": str(stack_home),
           "RLFLOW_CACHE": str(tmp_path_factory.mktemp("cache")), "PYTHONPATH": str(REPO)}
    return Cli(env)
