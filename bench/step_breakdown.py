"""Benchmark: where an iteration's time goes, from the metrics a real `rlflow train` run writes.

    python bench/step_breakdown.py [--iterations 12] [--work DIR] [--workload default|W2] [key=value ...]

It runs `rlflow train` (the default config, or bench/vs_trl.py's W2 workload) against its own local
stack, then reads every iteration's metrics object. Per iteration:

    iteration = timing_s/iteration      the whole iteration as the user waits for it: the Prefect
                                         subflow, its stage tasks on Ray, buffers, validation
    compute   = gen + old_log_prob + ref + values + adv + update_actor + update_critic + weight_sync
                                         (engine time on the critical path; reward runs beside the
                                         log-probs when those run, else it is on the path and counted
                                         as orchestration, being milliseconds of rule scoring)
    orchestration = iteration - compute  Prefect, Ray, storage: the fixed cost of a step

Medians over iterations 3..N (the first two start Ray's worker processes), each as a share of the
iteration.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.vs_trl import LR, WARMUP, WORKLOADS, build_inputs  # noqa: E402

COMPUTE = ("gen", "gen_baseline", "old_log_prob", "ref", "values", "adv", "update_actor", "update_critic",
           "weight_sync")  # fmt: skip


def workload_overrides(work: Path, name: str) -> list[str]:
    if name == "default":
        return []
    spec = WORKLOADS[name]
    model, data = build_inputs(work, name)
    return [f"model.path={model}", f"data.train_files=[{data}]", f"data.train_batch_size={spec['prompts']}",
            f"rollout.n={spec['n']}", f"rollout.max_new_tokens={spec['max_new_tokens']}", f"actor.lr={LR}",
            f"actor.mini_batch_size={spec['prompts'] * spec['n']}", *spec["rlflow"]]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--workload", choices=("default", *WORKLOADS), default="default")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "rlflow-bench")
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    work = args.work.expanduser().resolve()
    root = work / "out" / f"breakdown-{args.workload}"
    shutil.rmtree(root, ignore_errors=True)

    from infra.config import StackConfig
    from infra.node import free_port
    from infra.stack import LocalStack

    home = work / "home-breakdown"
    stack = LocalStack(StackConfig(home=str(home), prefect_port=free_port(), ray_port=free_port()))
    stack.up()
    try:
        overrides = [*workload_overrides(work, args.workload), f"trainer.total_iterations={args.iterations}",
                     "trainer.val_every=0", f"trainer.save_every={args.iterations}", "trainer.export_at_end=false",
                     "trainer.run_id=breakdown", f"storage.root={root}", *args.extra]  # fmt: skip
        env = {"RLFLOW_HOME": str(home), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        subprocess.run([sys.executable, "-m", "flows.cli", "train", *overrides], check=True, cwd=REPO,
                       env={**__import__("os").environ, **env}, stdout=subprocess.DEVNULL)  # fmt: skip
    finally:
        stack.down()
    rows = sorted((json.loads(p.read_text()) for p in root.rglob("metrics/iter_*.json")), key=lambda m: m["iteration"])
    rows = [m for m in rows if m["iteration"] > WARMUP]
    total = statistics.median(m["timing_s/iteration"] for m in rows)
    keys = sorted({k for m in rows for k in m if k.startswith("timing_s/")} - {"timing_s/iteration"})
    table = {k: statistics.median(m.get(k, 0.0) for m in rows) for k in keys}
    compute = statistics.median(sum(m.get(f"timing_s/{k}", 0.0) for k in COMPUTE) for m in rows)
    orchestration = statistics.median(m["timing_s/iteration"] - sum(m.get(f"timing_s/{k}", 0.0) for k in COMPUTE)
                                      for m in rows)  # fmt: skip
    print(f"workload {args.workload}: {len(rows)} iterations after {WARMUP} warm-up; median iteration {total:.3f} s")
    print("| part | median s | share of the iteration |")
    print("|---|---|---|")
    for k, v in table.items():
        print(f"| {k} | {v:.3f} | {v / total:.1%} |")
    print(f"| engine compute (sum) | {compute:.3f} | {compute / total:.1%} |")
    print(f"| orchestration (iteration - compute) | {orchestration:.3f} | {orchestration / total:.1%} |")
    out = REPO / "bench" / "results" / f"breakdown_{args.workload}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "iteration_s": total, "medians": table,
                               "compute_s": compute, "orchestration_s": orchestration}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
