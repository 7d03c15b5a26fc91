"""Benchmark: a demo build's warm start at 1 thread and at `--threads` threads, side by side.

    python bench/build_threads.py [--steps 40] [--tasks calc arith] [--threads 2]

For each task: the tiny model's warm start (engine.demo.tiny.warm_start, the part of a build that takes
minutes) for `steps` steps at 1 thread and at `threads`, alternating which goes first; the seconds of
each, the speed-up, and whether the weights' sha256 is the same (engine.demo.tiny.BUILD_THREADS may be
more than 1 only where it is on every machine: the cache and every resume rely on one set of bits per
task and seed).
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
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"| task | steps | 1 thread (s) | {args.threads} threads (s) | speed-up | same bits |")
    print("|---|---:|---:|---:|---:|---|")
    for i, task in enumerate(args.tasks):
        order = (1, args.threads) if i % 2 == 0 else (args.threads, 1)
        runs = {threads: warm(task, args.steps, threads) for threads in order}
        (one, one_sha), (many, many_sha) = runs[1], runs[args.threads]
        print(f"| {task} | {args.steps} | {one:.1f} | {many:.1f} | {one / many:.2f}x | {one_sha == many_sha} |",
              flush=True)


if __name__ == "__main__":
    main()
