"""Benchmark: the engine alone (no Prefect): weight sync against model size, 1 against 2 ranks, and
time per token against batch size.

    python bench/engine_scaling.py [--repeats 3] [--work DIR] [--only sync,ranks,batch,split_sync]

It drives `engine.Engine` on a Ray head of the local stack (its own state folder under --work), the
way the stage tasks do, with sort-task prompts and the models of bench/vs_trl.py:

  sync:  `timing_s/weight_sync` (FSDP shards -> full state dict -> the rollout copy, on every rank)
         after each update, for three model sizes, 2 ranks; MB/s = fp32 parameter bytes / seconds.
  ranks: W2 (hidden 256, 4 layers), 512 completions of up to 32 tokens: generation, log-probs and one
         update with 1 rank (2 threads) and with 2 ranks (1 thread each); 1- and 2-rank engines
         alternate, medians over repeats.
  batch: W2, 2 ranks: generation and update at 64, 128, 256 and 512 completions; milliseconds per
         generated token (generation) and per trained token (update) show the fixed cost spreading.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.batch import Batch  # noqa: E402
from engine.config import ActorConfig, RolloutConfig  # noqa: E402
from engine.demo.synthetic import make_rows  # noqa: E402
from engine.demo.tiny import TinyShape, build_tiny  # noqa: E402
from engine.engine import Engine, EngineSpec  # noqa: E402
from engine.models.loading import load_tokenizer  # noqa: E402
from engine.models.tokens import encode_prompts  # noqa: E402
from engine.workers.policy import PolicySpec  # noqa: E402

SIZES = {  # name: (hidden, mlp, layers, folder under --work)
    "S (W1)": (128, 256, 2, "model-W1"),
    "M (W2)": (256, 512, 4, "model-W2"),
    "L": (512, 1024, 8, "model-L"),
}
N = 8
MAX_NEW = 32


def model_dir(work: Path, name: str) -> Path:
    hidden, mlp, layers, sub = SIZES[name]
    folder = work / sub
    if not (folder / "rlflow_tiny.json").exists():
        build_tiny(folder, task="sort", seed=0,
                   shape=TinyShape(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers))  # fmt: skip
    return folder


def start(model: Path, run_id: str, world_size: int, completions: int) -> Engine:
    # rlflow's settings for W2 in bench/vs_trl.py: micro-batches of 64 rows for the passes, one generate
    # call per rank.
    actor = ActorConfig(lr=2e-4, mini_batch_size=completions, micro_batch_size=64)
    rollout = RolloutConfig(n=N, max_new_tokens=MAX_NEW, micro_batch_size=max(64, completions // world_size))
    spec = EngineSpec(run_id=run_id, config_hash=run_id, world_size=world_size, num_cpus_per_rank=2 / world_size,
                      policy=PolicySpec(model_path=str(model), tokenizer_path=str(model), use_ref=False,
                                        rollout=rollout, actor=actor, total_iterations=1000))  # fmt: skip
    return Engine.start(spec)


def prompts(model: Path, count: int) -> Batch:
    tok = load_tokenizer(str(model))
    rows = make_rows("sort", count, seed=3)
    enc = encode_prompts(tok, [r["prompt"] for r in rows])
    return Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}, {}).repeat_interleave(N)


def step(engine: Engine, batch: Batch, version: int) -> dict[str, float]:
    """One generate -> log-probs -> update cycle; wall seconds of each and the token counts."""
    t0 = time.perf_counter()
    out = engine.generate(batch, iteration=version + 1, expected_version=version)
    t1 = time.perf_counter()
    old = engine.compute_log_prob(out, expected_version=version)
    t2 = time.perf_counter()
    gen = torch.Generator().manual_seed(version)
    adv = torch.randn(out["responses"].shape[0], 1, generator=gen) * out["response_mask"]
    metrics = engine.update_actor(out.with_tensors(old_logp=old["old_logp"], adv=adv), iteration=version + 1,
                                  expected_version=version)  # fmt: skip
    t3 = time.perf_counter()
    tokens = float(out["response_mask"].sum())
    return {"gen_s": t1 - t0, "logprob_s": t2 - t1, "update_s": t3 - t2, "sync_s": metrics["timing_s/weight_sync"],
            "gen_tokens": tokens, "train_tokens": float(out["attention_mask"].sum())}  # fmt: skip


def measure(model: Path, world_size: int, completions: int, cycles: int, tag: str) -> list[dict[str, float]]:
    engine = start(model, f"bench-{tag}", world_size, completions)
    try:
        batch = prompts(model, completions // N)
        step(engine, batch, 0)  # warm-up
        return [step(engine, batch, v) for v in range(1, cycles + 1)]
    finally:
        engine.stop()


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def bench_sync(work: Path, repeats: int) -> list[dict[str, Any]]:
    out = []
    for name in SIZES:
        model = model_dir(work, name)
        params = sum(t.numel() for t in _state(model).values())
        rows = measure(model, 2, 64, repeats + 2, "sync")
        sync = med(rows, "sync_s")
        out.append({"size": name, "params": params, "mb": params * 4 / 1e6, "sync_ms": sync * 1e3,
                    "mb_s": params * 4 / 1e6 / sync, "update_s": med(rows, "update_s")})  # fmt: skip
        print(f"[sync] {name}: {params:,} params, {sync * 1e3:.1f} ms, {params * 4 / 1e6 / sync:.0f} MB/s", flush=True)
    return out


def bench_split_sync(work: Path, repeats: int) -> list[dict[str, Any]]:
    """Split placement (1 training rank + 1 rollout rank): the bucketed sync over the gloo group that spans
    them (`Engine.sync_weights`: gather on the training rank, broadcast bucket by bucket, the rollout's
    version set last), against model size and bucket size; medians of `repeats` syncs after one warm-up."""
    out = []
    for name in SIZES:
        model = model_dir(work, name)
        params = sum(t.numel() for t in _state(model).values())
        for bucket_mb in (1.0, 32.0):
            actor = ActorConfig(lr=2e-4, mini_batch_size=64, micro_batch_size=64)
            spec = EngineSpec(run_id="bench-split-sync", config_hash="bench-split-sync", world_size=1,
                              num_cpus_per_rank=1, rollout_ranks=1, rollout_num_cpus_per_rank=1,
                              sync_bucket_mb=bucket_mb,
                              policy=PolicySpec(model_path=str(model), tokenizer_path=str(model), use_ref=False,
                                                rollout=RolloutConfig(n=N, max_new_tokens=MAX_NEW), actor=actor,
                                                total_iterations=1000))  # fmt: skip
            engine = Engine.start(spec)
            try:
                engine.sync_weights(0)  # warm-up
                rows = []
                for _ in range(repeats):
                    began = time.perf_counter()
                    metrics = engine.sync_weights(0)
                    rows.append({"wall_s": time.perf_counter() - began, **metrics})
            finally:
                engine.stop()
            wall = med(rows, "wall_s")
            mb = med(rows, "perf/weight_sync_mb")
            out.append({"size": name, "params": params, "bucket_mb": bucket_mb, "mb_sent": mb, "wall_ms": wall * 1e3,
                        "sender_ms": med(rows, "timing_s/weight_sync") * 1e3,
                        "gather_ms": med(rows, "timing_s/weight_sync_gather") * 1e3, "mb_s": mb / wall})  # fmt: skip
            print(f"[split_sync] {name}, buckets of {bucket_mb:g} MB: {mb:.1f} MB in {wall * 1e3:.1f} ms "
                  f"({mb / wall:.0f} MB/s)", flush=True)
    return out


def _state(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model / "model.safetensors"))


def bench_ranks(work: Path, repeats: int) -> dict[str, Any]:
    model = model_dir(work, "M (W2)")
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for rep in range(repeats):
        for ws in ((1, 2) if rep % 2 == 0 else (2, 1)):
            rows = measure(model, ws, 512, 2, f"ranks{ws}")
            runs[ws] += rows
            print(f"[ranks] {ws} rank(s) rep {rep}: gen {med(rows, 'gen_s'):.2f} s, logprob "
                  f"{med(rows, 'logprob_s'):.2f} s, update {med(rows, 'update_s'):.2f} s", flush=True)
    result = {ws: {k: med(rows, k) for k in ("gen_s", "logprob_s", "update_s", "sync_s")} for ws, rows in runs.items()}
    result["speedup"] = {k: result[1][k] / result[2][k] for k in ("gen_s", "logprob_s", "update_s")}
    return result


def bench_batch(work: Path, repeats: int) -> list[dict[str, Any]]:
    model = model_dir(work, "M (W2)")
    out = []
    for completions in (64, 128, 256, 512):
        rows = measure(model, 2, completions, repeats, f"batch{completions}")
        gen, upd = med(rows, "gen_s"), med(rows, "update_s") + med(rows, "logprob_s")
        out.append({"completions": completions, "gen_s": gen, "train_s": upd,
                    "gen_ms_per_token": gen / med(rows, "gen_tokens") * 1e3,
                    "train_ms_per_token": upd / med(rows, "train_tokens") * 1e3})  # fmt: skip
        print(f"[batch] {completions}: gen {gen:.2f} s ({out[-1]['gen_ms_per_token']:.3f} ms/token), train "
              f"{upd:.2f} s ({out[-1]['train_ms_per_token']:.4f} ms/token)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="sync,ranks,batch")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "rlflow-bench")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "engine_scaling.json")
    args = parser.parse_args()
    work = args.work.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)

    import ray

    from infra.config import StackConfig
    from infra.node import free_port
    from infra.stack import LocalStack, apply_connect_env

    stack = LocalStack(StackConfig(home=str(work / "home-engine"), prefect_port=free_port(), ray_port=free_port()))
    info = stack.up().info()
    results: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    try:
        apply_connect_env(info)
        ray.init(address=info.ray_address, namespace="rlflow", log_to_driver=False)
        parts = args.only.split(",")
        if "sync" in parts:
            results["sync"] = bench_sync(work, args.repeats)
        if "ranks" in parts:
            results["ranks"] = bench_ranks(work, args.repeats)
        if "batch" in parts:
            results["batch"] = bench_batch(work, args.repeats)
        if "split_sync" in parts:
            results["split_sync"] = bench_split_sync(work, args.repeats)
    finally:
        ray.shutdown()
        stack.down()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
