"""Run generated code in a child process with a wall-clock timeout and a memory cap.

One fresh `python -I` child runs a batch of jobs one after another and writes one JSON line per job,
so a batch pays the interpreter start once. Each job gets `timeout_s` of wall clock from the moment the
previous one finished; a job that runs over is killed with its whole process group, recorded as
"timeout", and a new child takes the jobs after it, so a hang never loses the other jobs' results.
Inside the child, `RLIMIT_AS` caps the address space at `memory_mb`: an allocation beyond it raises
MemoryError in the job ("memory") instead of taking the machine down.

Who is to blame decides what happens (see engine.rewards.python_expr for how scores follow):
  * anything a job does once the child is ready — raise, loop forever, exhaust memory, crash the
    interpreter, print garbage — is the generated program's doing and becomes that job's status;
  * a child that cannot even start (no interpreter, a cap too small to import json) is a broken
    environment and raises RewardError: it must fail the stage, not score every response 0.

This contains accidents, not adversaries: the child runs as the same user with the same file system.
It gets an empty environment (no credentials from ours), a fresh temporary working directory, stdout
and stderr sent to /dev/null, and no core dumps.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import IO, Any, Literal

from engine.errors import RewardError
from engine.rewards.types import SandboxLimits

Status = Literal["ok", "error", "timeout", "memory", "crashed"]

_STARTUP_TIMEOUT_S = 30.0  # generous: a cold interpreter on a loaded machine

# The child. It reads every job first (so the parent's write never blocks on a full pipe), keeps a
# private copy of stdout for results, caps its address space, then points fds 1 and 2 at /dev/null so a
# job's prints cannot corrupt the protocol, and says "ready".
_CHILD = r"""
import json, os, resource, sys
jobs = json.loads(sys.stdin.read())
results = os.fdopen(os.dup(1), "w")
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
cap = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
probe = bytearray(8 << 20)  # a cap with no room for any job fails here, loudly, not as a 0 for every job
del probe
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
os.dup2(null, 2)
results.write('{"ready": true}\n')
results.flush()
for job in jobs:
    env = {} if job["builtins"] else {"__builtins__": {}}
    try:
        code = compile(job["code"], "<generated>", job["mode"])
        if job["mode"] == "eval":
            value = eval(code, env)
        else:
            exec(code, env)
            value = env.get("result")
        line = json.dumps({"status": "ok", "value": value})
    except MemoryError:
        env = code = value = None
        line = '{"status": "memory", "detail": "MemoryError"}'
    except BaseException as err:
        try:
            detail = (type(err).__name__ + ": " + str(err))[:300]
        except BaseException:
            detail = type(err).__name__
        line = json.dumps({"status": "error", "detail": detail})
    env = code = value = None
    results.write(line + "\n")
    results.flush()
"""


@dataclass(frozen=True)
class SandboxJob:
    """Source to run. `eval`: the value of an expression. `exec`: the global `result` after the code ran.

    The value must be JSON-able (numbers, strings, lists, dicts); anything else is an "error".
    `builtins=False` runs with no builtins at all (enough for arithmetic).
    """

    code: str
    mode: Literal["eval", "exec"] = "eval"
    builtins: bool = False


@dataclass(frozen=True)
class SandboxResult:
    status: Status
    value: Any = None
    detail: str = ""
    elapsed_s: float = 0.0


def run_sandboxed(jobs: Sequence[SandboxJob], limits: SandboxLimits) -> list[SandboxResult]:
    """Run `jobs` in child processes under `limits`; one result per job, in order."""
    results: list[SandboxResult] = []
    while len(results) < len(jobs):
        results.extend(_run_child(jobs[len(results) :], limits))
    return results


def _run_child(jobs: Sequence[SandboxJob], limits: SandboxLimits) -> list[SandboxResult]:
    """Run jobs in one child until they are done or one kills it; at least one result comes back."""
    payload = json.dumps([asdict(job) for job in jobs]).encode()
    cap_bytes = limits.memory_mb * 2**20
    with tempfile.TemporaryDirectory(prefix="rlflow-sandbox-") as cwd, tempfile.TemporaryFile() as stderr:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _CHILD, str(cap_bytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=cwd,
                env={"PATH": os.defpath},
                start_new_session=True,
            )
        except OSError as err:
            raise RewardError(f"the reward sandbox could not start {sys.executable}: {err}") from err
        lines: queue.Queue[bytes | None] = queue.Queue()
        reader = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
        reader.start()
        try:
            _send(proc, payload)
            _await_ready(proc, lines, stderr, limits)
            return _collect(proc, jobs, lines, limits)
        finally:
            _kill(proc)
            reader.join(timeout=5)


def _send(proc: subprocess.Popen[bytes], payload: bytes) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the child died before reading; _await_ready reports why


def _await_ready(
    proc: subprocess.Popen[bytes], lines: queue.Queue[bytes | None], stderr: IO[bytes], limits: SandboxLimits
) -> None:
    try:
        line = lines.get(timeout=_STARTUP_TIMEOUT_S)
    except queue.Empty:
        line = None
    if line is not None and line.strip() == b'{"ready": true}':
        return
    _kill(proc)
    stderr.seek(0)
    tail = stderr.read().decode(errors="replace").strip().splitlines()[-3:]
    raise RewardError(
        f"the reward sandbox could not start (exit code {proc.returncode}, sandbox_memory_mb="
        f"{limits.memory_mb}): {' | '.join(tail) or 'no output'}; raise reward.sandbox_memory_mb if it is tiny"
    )


def _collect(
    proc: subprocess.Popen[bytes],
    jobs: Sequence[SandboxJob],
    lines: queue.Queue[bytes | None],
    limits: SandboxLimits,
) -> list[SandboxResult]:
    results: list[SandboxResult] = []
    start = time.monotonic()  # each job's clock starts when the previous one's result arrived
    for _ in jobs:
        try:
            line = lines.get(timeout=max(0.0, start + limits.timeout_s - time.monotonic()))
        except queue.Empty:
            _kill(proc)
            elapsed = time.monotonic() - start
            return results + [
                SandboxResult("timeout", detail=f"killed after {elapsed:.2f} s", elapsed_s=elapsed)
            ]
        now = time.monotonic()
        elapsed, start = now - start, now
        record = _parse(line)
        if record is None:  # the child died mid-job, or the job wrote over the protocol
            _kill(proc)
            detail = f"the interpreter exited with code {proc.returncode}" if line is None else "bad output"
            return results + [SandboxResult("crashed", detail=detail, elapsed_s=elapsed)]
        results.append(
            SandboxResult(record["status"], record.get("value"), record.get("detail", ""), elapsed)
        )
    return results


def _parse(line: bytes | None) -> dict[str, Any] | None:
    if line is None:
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(record, dict) and record.get("status") in ("ok", "error", "memory")
    return record if ok else None


def _pump(stream: IO[bytes], lines: queue.Queue[bytes | None]) -> None:
    for line in iter(stream.readline, b""):
        lines.put(line)
    lines.put(None)  # end of output: the child exited or was killed


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child and anything it started (its own session), then reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
