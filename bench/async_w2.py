"""Benchmark: the asynchronous schedule against the colocated on-policy loop, side by side in one run.

    python bench/async_w2.py [--steps 10] [--workload W2] [--trl]

Same total cores (2): colocated, 2 ranks, trainer.max_staleness=0 (today's loop) against split placement,
1 training rank + 1 rollout rank, k = 1. Per run: seconds per step (median over steps 3..N of the time
between two iteration commits, the only step time that means something when iterations overlap),
generated tokens per second, the time in which no rank computes (from trace/timeline.json: the union
of every rank's traced calls over steps 3..N), and the training reward at the end. With --trl, TRL's
GRPOTrainer runs the same workload in the same run of the script (bench/vs_trl.py's runner; its step is
the time between its on_step_end callbacks), and both rlflow variants are given as a ratio to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.vs_trl import WORKLOADS, build_inputs, run_rlflow, run_trl, trl_python  # noqa: E402
from flows.trace import busy_time  # noqa: E402

VARIANTS = {"colocated k=0 (2 ranks)": (2, []),
            "split 1+1, k=1": (1, ["placement.mode=split", "placement.rollout_ranks=1", "trainer.max_staleness=1"])}


def measure(run_dir: Path, completions: int) -> dict[str, float]:
    rows = sorted((json.loads(p.read_text()) for p in run_dir.glob("metrics/iter_*.json")), key=lambda m: m["iteration"])
    rows = [m for m in rows if m["iteration"] >= 1]
    events = json.loads((run_dir / "trace" / "timeline.json").read_text())["traceEvents"]
    stages = [e for e in events if e.get("ph") == "X" and e["pid"] == 1]
    ends = {}
    for e in stages:  # an iteration's last stage end (its commit follows within milliseconds)
        i = e["args"]["iteration"]
        ends[i] = max(ends.get(i, 0.0), (e["ts"] + e["dur"]) / 1e6)
    steps = sorted(ends)
    steady = steps[2:]
    step_s = [ends[i] - ends[i - 1] for i in steady]
    window = (ends[steady[0] - 1], ends[steady[-1]])
    idle = (window[1] - window[0]) - busy_time(events, *window)
    gen = [m["response_length/mean"] * completions for m in rows if m["iteration"] in steady]
    return {"s_per_step": statistics.median(step_s), "gen_tok_s": statistics.median(gen) / statistics.median(step_s),
            "idle_share": idle / (window[1] - window[0]), "idle_s_per_step": idle / len(steady),
            "reward_first": rows[0]["critic/score/mean"], "reward_last3": statistics.mean(
                m["critic/score/mean"] for m in rows[-3:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workload", default="W2")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "rlflow-bench")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "async_w2.json")
    parser.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer on the workload")
    args = parser.parse_args()
    from infra.config import StackConfig
    from infra.node import free_port
    from infra.stack import LocalStack

    work = args.work.expanduser().resolve()
    home = work / "home-async"
    spec = WORKLOADS[args.workload]
    model, data = build_inputs(work, args.workload)
    stack = LocalStack(StackConfig(home=str(home), prefect_port=free_port(), ray_port=free_port()))
    stack.up()
    results = {}
    try:
        for name, (ranks, extra) in VARIANTS.items():
            tag = "async" if extra else "colocated"
            run_rlflow(work, args.workload, model, data, 0.0, args.steps, tag, ranks, home, extra)
            run_dir = work / "out" / f"rlflow-{args.workload}-b0.0-{tag}" / "runs" / f"bench-{args.workload}-{tag}"
            results[name] = measure(run_dir, spec["prompts"] * spec["n"])
            print(name, {k: round(v, 3) for k, v in results[name].items()}, flush=True)
    finally:
        stack.down()
    if args.trl:
        trl = run_trl(trl_python(work), work, args.workload, model, data, 0.0, args.steps, "async-bench", {})
        results["TRL"] = {"s_per_step": trl["s_per_step"], "gen_tok_s": trl["gen_tok_s"],
                          "reward_first": trl["reward_first"], "reward_last3": trl["reward_last3"]}
        print("TRL", {k: round(v, 3) for k, v in results["TRL"].items()}, flush=True)
        for name in VARIANTS:
            print(f"{name} / TRL (speed): {trl['s_per_step'] / results[name]['s_per_step']:.2f}x")
    base, fast = (results[name] for name in VARIANTS)
    print(f"speed-up {base['s_per_step'] / fast['s_per_step']:.2f}x")
    args.out.write_text(json.dumps({"workload": args.workload, "steps": args.steps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
