"""The type checker over the modules that are type-clean today (a type checker in CI: docs/architecture.md).

engine/workers, engine/engine.py, tasks/ and most of flows/ are not yet: `Batch.__getitem__` returns
`Tensor | list`, so their tensor accesses need `batch.tensors[...]` first. Add modules here as they pass.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TYPED = ["engine/algos", "engine/batch.py", "engine/config.py", "engine/rewards", "engine/data",
         "engine/models/__init__.py", "engine/models/loading.py", "engine/models/tokens.py", "engine/demo/tiny.py", "engine/cpu_kernels.py", "engine/_dists.py", "engine/rollout/__init__.py", "engine/rollout/backends.py", "engine/rollout/base.py", "engine/rollout/hf.py", "engine/rollout/vllm.py", "engine/rollout/tools.py", "engine/models/lora.py", "engine/models/gguf_import.py", "engine/models/fetch.py", "engine/workers/memory.py", "infra", "flows/loggers.py",
         "tasks/runner.py"]


def test_typed_modules_pass_mypy() -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", *TYPED], cwd=REPO, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.startswith("Success"), proc.stdout
