"""Which CPU kernels torch runs, so that a run's floating-point results do not depend on the machine.

torch, MKL and oneDNN pick their kernels by the CPU they find: AVX-512 on one machine, AVX2 on another.
The kernels sum in different orders, so the same run on the same code gives other bytes, and after a
few hundred optimizer steps another score (the tiny sort model's warm start and one GRPO iteration:
0.760 on an AVX-512 machine, 0.757 on AVX2 ones). Pinned to AVX2, which every x86-64 CPU of the last
decade has, every such machine computes the same bytes. Each variable must be set before the library
reads it (torch: at import), so the pinned environment goes to processes not yet started: the Ray
workers and ranks (flows.train.worker_env) and the tiny model's build (engine.demo.tiny.cached_tiny).

`placement.cpu_kernels`: auto (AVX2 where the CPU has it, else the native kernels), avx2 (refused on a
CPU without AVX2), native (the fastest the CPU has; results then depend on the CPU).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

from engine.errors import ConfigError, RLFlowError

MODES = ("auto", "avx2", "native")

# ATen's vectorised kernels, MKL's code path (its "conditional numerical reproducibility" switch) and
# oneDNN's instruction set: the three places torch chooses by CPU.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@cache
def has_avx2() -> bool:
    """Whether this CPU has AVX2 (and FMA, which ATen's avx2 kernels use); False off x86-64 Linux."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    return False


def kernel_env(mode: str) -> dict[str, str]:
    """The environment variables that pin the kernels for `mode` (empty: the native ones)."""
    if mode not in MODES:
        raise ConfigError(f"placement.cpu_kernels={mode!r}; allowed: {', '.join(MODES)}")
    if mode == "native" or (mode == "auto" and not has_avx2()):
        return {}
    if not has_avx2():
        raise ConfigError("placement.cpu_kernels=avx2: this CPU has no AVX2; use auto or native")
    return dict(AVX2_ENV)


def kernel_tag(env: dict[str, str]) -> str:
    """A short name of the kernels `env` selects, for cache names: avx2 or native."""
    return "avx2" if env.get("ATEN_CPU_CAPABILITY") == "avx2" else "native"


def pinned_here(env: dict[str, str]) -> bool:
    """Whether this process already runs with `env` (set before torch was imported)."""
    return all(os.environ.get(key) == value for key, value in env.items()) and \
        (bool(env) or "ATEN_CPU_CAPABILITY" not in os.environ)


def run_module_pinned(module: str, argv: list[str], env: dict[str, str], what: str,
                      on_line: Callable[[str], object] | None = None,
                      exit_errors: dict[int, type[Exception]] | None = None) -> None:
    """`python -m module *argv` in a new process whose kernels `env` pins (kernel_env; empty: the
    native ones) in place of this one's, with this checkout importable; its stdout lines go to
    `on_line`. Raises RLFlowError("`what` failed: <its last error line>") when it fails, or the error
    `exit_errors` names for its exit code, with its last error line (a failure the caller tells apart)."""
    child_env = {key: value for key, value in os.environ.items() if key not in AVX2_ENV}
    child_env.update(env)
    root = str(Path(__file__).resolve().parents[1])  # the checkout: engine/cpu_kernels.py
    child_env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.TemporaryFile("w+") as errors:
        child = subprocess.Popen([sys.executable, "-m", module, *argv], env=child_env,
                                 stdout=subprocess.PIPE, stderr=errors, text=True)
        assert child.stdout is not None
        for line in child.stdout:
            if on_line is not None:
                on_line(line)
        returncode = child.wait()
        errors.seek(0)
        stderr = errors.read()
    if returncode != 0:
        last = (stderr.strip().splitlines() or ["(no output)"])[-1]
        if exit_errors and returncode in exit_errors:
            raise exit_errors[returncode](last)
        raise RLFlowError(f"{what} failed: {last}")
