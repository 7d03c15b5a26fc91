"""Benchmark: LoRA against full fine-tuning, side by side in one run.

    python bench/lora.py [--parts speed,sync,learn] [--steps 3] [--learn-iterations 30]

speed: W3 (bench/vs_trl.py: a 26.8 M Qwen2-shaped model with its BPE tokenizer, 8 prompts x 8 = 64
    completions of up to 256 tokens) with a k3 KL loss against the reference (beta 0.04), 2 ranks, a
    checkpoint committed every step: full fine-tuning against LoRA rank 8 and rank 32 (alpha = 2 x rank,
    all-linear, lr 10x). Per step (median over steps after the first): seconds, the largest rank's peak
    RSS, the committed checkpoint's bytes (its MANIFEST) and the save + commit time.
sync: the train-to-generate weight sync with rollout.weights=copy on the W3 model (Engine directly, 2
    ranks, 10 syncs each): the full weights against the adapters, seconds and MB.
learn: the default run (configs/tiny_grpo.yaml: the tiny model on the sort task), the same iterations
    and seed: full fine-tuning (lr 2e-4) against LoRA rank 8 and 32 (lr 2e-3): validation reward (sampled,
    256 prompts) before -> after.

Results: bench/results/lora.json; the table for BENCHMARKS.md is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import vs_trl  # noqa: E402  (bench/vs_trl.py: the W3 workload, its inputs and its rlflow runner)

BETA = 0.04
VARIANTS: dict[str, list[str]] = {
    "full": [],
    "lora-r8": ["actor.lora.rank=8", "actor.lora.alpha=16"],
    "lora-r32": ["actor.lora.rank=32", "actor.lora.alpha=64"],
}
LORA_LR_FACTOR = 10  # LoRA trains a few matrices from zero: the usual learning rate is ~10x full fine-tuning's


def lr_override(variant: str, lr: float) -> list[str]:
    return [f"actor.lr={lr * (LORA_LR_FACTOR if variant != 'full' else 1)}"]


def speed(work: Path, home: Path, steps: int) -> dict[str, Any]:
    model, data = vs_trl.build_inputs(work, "W3")
    out: dict[str, Any] = {}
    for variant, overrides in VARIANTS.items():
        extra = [*overrides, *lr_override(variant, vs_trl.WORKLOADS["W3"]["lr"]), "trainer.save_every=1"]
        res = vs_trl.run_rlflow(work, "W3", model, data, BETA, steps, f"lora-{variant}", 2, home, extra)
        run = work / "out" / f"rlflow-W3-b{BETA}-lora-{variant}" / "runs" / f"bench-W3-lora-{variant}"
        manifest = json.loads((run / "checkpoints" / f"step_{steps:06d}" / "MANIFEST.json").read_text())
        rows = [json.loads((run / "metrics" / f"iter_{i:06d}.json").read_text()) for i in range(1, steps + 1)]
        res["checkpoint_mb"] = manifest["total_bytes"] / 2**20
        log = (work / "out" / f"rlflow-W3-b{BETA}-lora-{variant}" / "log.txt").read_text()
        saves = [float(line.rsplit(" in ", 1)[1].split()[0]) for line in log.splitlines()
                 if "checkpoint step" in line and "committed:" in line]
        res["save_s"] = statistics.median(saves[1:] or saves)  # the first save also creates the folders
        res["update_s"] = statistics.median(m["timing_s/update_actor"] for m in rows[1:] or rows)
        res["gen_s"] = statistics.median(m["timing_s/gen"] for m in rows[1:] or rows)
        out[variant] = res
        print(f"[speed {variant}] {res['s_per_step']:.1f} s/step, rank peak {res['rank_peak_gb']:.2f} GB, "
              f"checkpoint {res['checkpoint_mb']:.2f} MB in {res['save_s']:.2f} s", flush=True)
    return out


def sync(work: Path, home: Path, repeats: int = 10) -> dict[str, Any]:
    from engine.config import ActorConfig, LoraConfig, RolloutConfig
    from engine.engine import Engine, EngineSpec
    from engine.workers.policy import PolicySpec
    from flows.commands.engine import connect

    model, _ = vs_trl.build_inputs(work, "W3")
    os.environ["RLFLOW_HOME"] = str(home)
    connect(None)
    out: dict[str, Any] = {}
    for variant, lora in (("full", LoraConfig()), ("lora-r8", LoraConfig(rank=8, alpha=16)),
                          ("lora-r32", LoraConfig(rank=32, alpha=64))):
        spec = EngineSpec(run_id=f"bench-sync-{variant}", config_hash="bench", world_size=2, num_cpus_per_rank=1,
                          policy=PolicySpec(model_path=str(model), tokenizer_path=str(model),
                                            rollout=RolloutConfig(weights="copy"), actor=ActorConfig(lora=lora)))
        engine = Engine.start(spec)
        try:
            runs = [engine.policy.call("sync_rollout_weights")[0] for _ in range(repeats + 1)][1:]
        finally:
            engine.stop()
        out[variant] = {"sync_s": statistics.median(r["timing_s/weight_sync"] for r in runs),
                        "sync_mb": runs[0]["perf/weight_sync_mb"]}
        print(f"[sync {variant}] {out[variant]['sync_s'] * 1000:.1f} ms, {out[variant]['sync_mb']:.2f} MB", flush=True)
    import ray

    ray.shutdown()  # this process leaves the cluster before the stack goes down
    return out


def learn(work: Path, home: Path, iterations: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    env = {**os.environ, "RLFLOW_HOME": str(home), "TOKENIZERS_PARALLELISM": "false"}
    for variant, overrides in VARIANTS.items():
        root = work / "out" / f"learn-{variant}"
        run_id = f"bench-learn-{variant}-{int(time.time())}"
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "flows.cli", "train", str(REPO / "configs" / "tiny_grpo.yaml"),
                        *overrides, *lr_override(variant, 2e-4), f"trainer.total_iterations={iterations}",
                        f"trainer.val_every={iterations // 3}", f"trainer.save_every={iterations}",
                        f"trainer.run_id={run_id}", f"storage.root={root}"],
                       cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        metrics = [json.loads(p.read_text()) for p in sorted((root / run_id / "metrics").glob("iter_*.json"))]
        vals = [(m["iteration"], m["val/score/mean"]) for m in metrics if "val/score/mean" in m]
        steps = [m["timing_s/iteration"] for m in metrics if m["iteration"] >= 1]
        out[variant] = {"val": vals, "before": vals[0][1], "after": vals[-1][1], "wall_s": wall,
                        "s_per_step": statistics.median(steps)}
        print(f"[learn {variant}] val {vals[0][1]:.3f} -> {vals[-1][1]:.3f} after {vals[-1][0]} iterations "
              f"({out[variant]['s_per_step']:.2f} s/step, {wall:.0f} s)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="speed,sync,learn")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--learn-iterations", type=int, default=30)
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "rlflow-bench")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "lora.json")
    args = parser.parse_args()
    from infra.config import StackConfig
    from infra.node import free_port
    from infra.stack import LocalStack

    work = args.work.expanduser().resolve()
    home = work / "home"
    stack = LocalStack(StackConfig(home=str(home), prefect_port=free_port(), ray_port=free_port()))
    stack.up()
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    results: dict[str, Any] = {**previous, "meta": {"command": " ".join(["lora.py", *sys.argv[1:]]), "beta": BETA,
                                        "steps": args.steps, "learn_iterations": args.learn_iterations}}
    try:
        for part in args.parts.split(","):
            fn = {"speed": lambda: speed(work, home, args.steps), "sync": lambda: sync(work, home),
                  "learn": lambda: learn(work, home, args.learn_iterations)}[part]
            results[part] = fn()
            args.out.write_text(json.dumps(results, indent=1))
    finally:
        stack.down()
    table(results)


def table(results: dict[str, Any]) -> None:
    speed, sync_, learn_ = results.get("speed", {}), results.get("sync", {}), results.get("learn", {})
    print("| | s/step (W3, KL) | rank peak GB | checkpoint MB | save + commit s | sync (copy) ms | sync MB "
          "| sort val reward before -> after |")
    print("|---|---|---|---|---|---|---|---|")
    for variant in VARIANTS:
        s, y, learned = speed.get(variant), sync_.get(variant), learn_.get(variant)
        cells = [f"{s['s_per_step']:.1f}", f"{s['rank_peak_gb']:.2f}", f"{s['checkpoint_mb']:.2f}", f"{s['save_s']:.2f}"] \
            if s else ["-"] * 4
        cells += [f"{y['sync_s'] * 1000:.1f}", f"{y['sync_mb']:.2f}"] if y else ["-"] * 2
        cells += [f"{learned['before']:.3f} -> {learned['after']:.3f}"] if learned else ["-"]
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
