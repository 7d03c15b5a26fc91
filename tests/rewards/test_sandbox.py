"""The code sandbox: timeouts kill, memory caps hold, and a bad job never loses the others' results."""

from __future__ import annotations

import json
import time

import pytest

from engine.config import RewardConfig
from engine.errors import RewardError
from engine.rewards import SandboxJob, SandboxLimits, run_sandboxed, score_batch
from engine.rewards import sandbox as sandbox_module

LIMITS = SandboxLimits(timeout_s=1.0, memory_mb=256)
MARGIN_S = 2.0  # process start and kill on a loaded 2-core machine


def test_jobs_run_in_one_child_and_return_json_values() -> None:
    results = run_sandboxed(
        [SandboxJob("2**10"), SandboxJob("result = {'a': [1, 2.5]}", mode="exec"), SandboxJob("7 // 2")],
        LIMITS,
    )
    assert [(r.status, r.value) for r in results] == [("ok", 1024), ("ok", {"a": [1, 2.5]}), ("ok", 3)]
    assert run_sandboxed([], LIMITS) == []


def test_an_infinite_loop_is_killed_within_its_timeout_and_the_rest_still_run() -> None:
    jobs = [SandboxJob("1+1"), SandboxJob("while True: pass", mode="exec"), SandboxJob("2+2")]
    start = time.monotonic()
    results = run_sandboxed(jobs, LIMITS)
    elapsed = time.monotonic() - start
    assert [r.status for r in results] == ["ok", "timeout", "ok"]
    assert results[2].value == 4  # run by a fresh child after the kill
    assert LIMITS.timeout_s <= results[1].elapsed_s < LIMITS.timeout_s + MARGIN_S
    assert elapsed < LIMITS.timeout_s + MARGIN_S


def test_a_memory_hog_stops_at_the_cap_not_at_the_timeout() -> None:
    limits = SandboxLimits(timeout_s=20.0, memory_mb=128)
    hog = "chunks = []\nwhile True:\n    chunks.append(b'x' * 2**20)"  # grows 1 MiB at a time
    start = time.monotonic()
    results = run_sandboxed(
        [SandboxJob(hog, mode="exec"), SandboxJob("b'x' * 2**34"), SandboxJob("6*7")], limits
    )
    elapsed = time.monotonic() - start
    assert [r.status for r in results] == ["memory", "memory", "ok"]
    assert results[2].value == 42  # the child survives a MemoryError and goes on
    assert elapsed < 10.0  # the cap stopped it, long before the 20 s timeout


def test_errors_crashes_and_prints_are_per_job() -> None:
    jobs = [
        SandboxJob("1/0"),
        SandboxJob("__import__('os')"),  # no builtins: no imports
        SandboxJob("result = 10**5000", mode="exec"),  # not JSON-able: too many digits
        SandboxJob("print('garbage'); result = 1", mode="exec", builtins=True),
        SandboxJob("import os; os._exit(3)", mode="exec", builtins=True),
        SandboxJob("3"),
    ]
    results = run_sandboxed(jobs, LIMITS)
    assert [r.status for r in results] == ["error", "error", "error", "ok", "crashed", "ok"]
    assert results[0].detail == "ZeroDivisionError: division by zero"
    assert results[1].detail.startswith("NameError")
    assert results[3].value == 1 and results[5].value == 3
    assert "exited with code" in results[4].detail


def test_the_child_gets_no_environment() -> None:
    job = SandboxJob("import os; result = dict(os.environ)", mode="exec", builtins=True)
    (result,) = run_sandboxed([job], LIMITS)
    assert result.status == "ok" and set(result.value) <= {"PATH", "LC_CTYPE"}


def test_a_sandbox_that_cannot_start_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        RewardError, match=r"could not start \(exit code 1, sandbox_memory_mb=4\).*MemoryError"
    ):
        run_sandboxed([SandboxJob("1")], SandboxLimits(timeout_s=1.0, memory_mb=4))
    monkeypatch.setattr(sandbox_module, "_CHILD", "import sys; print('boom', file=sys.stderr); sys.exit(3)")
    with pytest.raises(RewardError, match=r"could not start \(exit code 3.*\): boom"):
        run_sandboxed([SandboxJob("1")], LIMITS)


def test_limits_come_from_the_reward_config() -> None:
    cfg = RewardConfig(sandbox_timeout_s=0.5, sandbox_memory_mb=300)
    assert SandboxLimits.from_config(cfg) == SandboxLimits(timeout_s=0.5, memory_mb=300)
    truth = json.dumps({"target": 1, "numbers": [9, 9, 9]})
    start = time.monotonic()
    batch = score_batch(["rlflow/countdown"], ["#### 9**9**9"], [truth], cfg=cfg)
    assert batch.scores == [0.0] and batch.counts() in ({"timeout": 1}, {"memory": 1})
    assert time.monotonic() - start < 0.5 + MARGIN_S
