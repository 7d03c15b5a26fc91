"""Benchmark: what the sandbox costs per call, side by side in one run.

    python bench/sandbox_overhead.py [--jobs 200] [--repeat 5] [--before PATH]

Per variant: one `run_sandboxed` call of N trivial jobs (a code reward's shape: `1 + 1`, no builtins) and of
N tool-shaped jobs (`import json` and a small result), the median over the repeats, as milliseconds per job
and per batch. Variants: isolation "bwrap" (bubblewrap, a clean worker forked per job) and "none" (the same
runner, unconfined); with --before PATH, a sandbox module of another commit (for example main's, written out
with `git show main:engine/rewards/sandbox.py > /tmp/sandbox_main.py`), which ran every job of a batch in one
child, one after another.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.rewards import sandbox  # noqa: E402
from engine.rewards.types import SandboxLimits  # noqa: E402

TOOL = "import json\nresult = json.dumps({'answer': 42})"


def timed(module: Any, jobs: list[Any], limits: SandboxLimits, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        results = module.run_sandboxed(jobs, limits)
        times.append(time.perf_counter() - start)
        assert all(r.status == "ok" for r in results), results[:3]
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--before", default=None, help="a sandbox.py of another commit, run as 'before'")
    args = parser.parse_args()
    variants: list[tuple[str, Any, SandboxLimits]] = [
        ("bwrap (this commit)", sandbox, SandboxLimits(timeout_s=10.0, memory_mb=512, isolation="bwrap")),
        ("none (this commit)", sandbox, SandboxLimits(timeout_s=10.0, memory_mb=512, isolation="none")),
    ]
    if args.before:
        spec = importlib.util.spec_from_file_location("sandbox_before", args.before)
        assert spec is not None and spec.loader is not None
        before = importlib.util.module_from_spec(spec)
        sys.modules["sandbox_before"] = before  # dataclasses look their module up while it loads
        spec.loader.exec_module(before)
        variants.append(("before (--before)", before, SandboxLimits(timeout_s=10.0, memory_mb=512)))
    print(f"{args.jobs} jobs per batch, median of {args.repeat}")
    print(f"{'variant':<22} {'code: ms/job':>13} {'code: ms/batch':>15} {'tool: ms/job':>13} {'tool: ms/batch':>15}")
    for name, module, limits in variants:
        code = [module.SandboxJob("1 + 1") for _ in range(args.jobs)]
        tool = [module.SandboxJob(TOOL, mode="exec", builtins=True) for _ in range(args.jobs)]
        c, t = timed(module, code, limits, args.repeat), timed(module, tool, limits, args.repeat)
        print(f"{name:<22} {c / args.jobs * 1000:>13.2f} {c * 1000:>15.0f} {t / args.jobs * 1000:>13.2f} "
              f"{t * 1000:>15.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
