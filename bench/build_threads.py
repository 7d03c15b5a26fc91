"""Benchmark: a demo build's warm start at 1 thread and at BUILD_THREADS, side by side.

    python bench/build_threads.py [--steps 40] [--tasks calc arith]

For each task: the tiny model's warm start (engine.demo.tiny.warm_start, the part of a build that takes
minutes) for `steps` steps at 1 thread and at engine.demo.tiny.BUILD_THREADS, alternating which goes
first; the seconds of each, the speed-up, and whether the weights' sha256 is the same (it must be: the
cache and every resume rely on one set of bits per task and seed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.demo import tiny  # noqa: E402


def warm(task: str, steps: int, threads: int) -> tuple[float, str]:
    with tiny.deterministic_cpu(threads):
        tokenizer = tiny.build_tokenizer()
        model = tiny.build_model(tokenizer, 0, tiny.SHAPE)
        start = time.perf_counter()
        tiny.warm_start(model, tokenizer, task, 0, steps)
        seconds = time.perf_counter() - start
    return seconds, tiny.weights_sha256(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tasks", nargs="+", default=["calc", "arith"])
    args = parser.parse_args()
    print(f"| task | steps | 1 thread (s) | {tiny.BUILD_THREADS} threads (s) | speed-up | same bits |")
    print("|---|---:|---:|---:|---:|---|")
    for i, task in enumerate(args.tasks):
        order = (1, tiny.BUILD_THREADS) if i % 2 == 0 else (tiny.BUILD_THREADS, 1)
        runs = {threads: warm(task, args.steps, threads) for threads in order}
        (one, one_sha), (many, many_sha) = runs[1], runs[tiny.BUILD_THREADS]
        print(f"| {task} | {args.steps} | {one:.1f} | {many:.1f} | {one / many:.2f}x | {one_sha == many_sha} |",
              flush=True)


if __name__ == "__main__":
    main()
