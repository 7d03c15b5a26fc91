"""Benchmark: the checkpoint path training takes, against raw s3fs on the same bytes and endpoint.

    python bench/store_checkpoint.py [--hidden 1024] [--layers 4] [--repeats 3]

A 2-rank FSDP2 engine holds a Llama of about 200 MB of fp32 weights (hidden 1024, MLP 2816, 4 layers;
the checkpoint with AdamW's two moments is ~3x that). On a local S3 server (python -m infra.s3server):

  save (store):    CheckpointStore.begin -> Engine.save (every rank writes its DCP shards and hashes
                   them as they go out) -> trainer.json -> commit (MANIFEST from the ranks' hashes,
                   LATEST, retention): what the save_checkpoint stage runs.
  restore (store): flows.train.restore: the manifest and a listing, then Engine.load, every rank reading
                   each of its files once and verifying its sha256 as it reads, into the FSDP shards,
                   the optimizer, and the rollout copy: what the train flow runs after a crash.
  raw s3fs:        `put(local_dir, remote, recursive=True)` / `get(remote, local_dir, recursive=True)` of
                   the same files (a copy of that checkpoint), s3fs/botocore defaults.

Store and raw alternate (A B, B A, ...); medians, MB/s of the checkpoint's bytes, and the ratio
store / raw (goal: >= 0.8x each way).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BUCKET = "bench"


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "infra.s3server", "--port", "0", "--bucket", BUCKET],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("endpoint "):
            import threading

            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, line.split()[1]
    raise RuntimeError("the S3 server did not start")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local Ray for the bench: no token file written
    from infra.s3server import env_for

    proc, endpoint = start_server()
    os.environ.update(env_for(endpoint))
    work = Path(tempfile.mkdtemp(prefix="rlflow-bench-"))
    import ray

    ray.init(num_cpus=4, namespace="rlflow", log_to_driver=False, include_dashboard=False,
             runtime_env={"env_vars": {k: os.environ[k] for k in env_for(endpoint)}})
    engine = None
    try:
        import s3fs

        from engine.config import ActorConfig
        from engine.demo.tiny import TinyShape, build_tiny
        from engine.engine import Engine, EngineSpec
        from engine.workers.policy import PolicySpec
        from flows.train import restore
        from infra.checkpoints import CheckpointStore
        from infra.store import ObjectStore

        model = work / "model"
        build_tiny(model, task="sort", seed=0, steps=0, shape=TinyShape(
            hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
            num_attention_heads=8))
        weights_mb = (model / "model.safetensors").stat().st_size / 2**20
        spec = EngineSpec(run_id="bench-ckpt", config_hash="bench", world_size=2, num_cpus_per_rank=1.0,
                          policy=PolicySpec(model_path=str(model), tokenizer_path=str(model), actor=ActorConfig()))
        engine = Engine.start(spec)
        store = ObjectStore(f"s3://{BUCKET}/store")
        opts = store.storage_options()
        ckpts = CheckpointStore(store, "bench", keep_last=1)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)

        def store_save(step: int) -> None:
            written = engine.save(ckpts.begin(step), opts)
            ckpts.write_trainer_state(step, {"iteration": step})
            ckpts.commit(step, written)

        def store_restore() -> None:
            assert restore(engine, ckpts, opts) is not None

        store_save(1)  # warm-up; and a copy of the same files for raw s3fs
        local = work / "copy"
        ckpts.fetch(1, str(local))
        total = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
        mb = total / 2**20
        print(f"model {weights_mb:.0f} MB of fp32 weights; checkpoint {mb:.0f} MB in "
              f"{sum(1 for p in local.rglob('*') if p.is_file())} files; 2 ranks; endpoint {endpoint}")
        store_restore()
        times: dict[str, list[float]] = {k: [] for k in ("store_save", "store_restore", "raw_put", "raw_get")}
        for rep in range(1, args.repeats + 1):
            for kind in (("store", "raw") if rep % 2 else ("raw", "store")):
                if kind == "store":
                    times["store_save"].append(timed(lambda: store_save(rep + 1)))
                    times["store_restore"].append(timed(store_restore))
                else:
                    remote = f"{BUCKET}/raw/{rep}"
                    dst = work / f"raw-{rep}"
                    times["raw_put"].append(timed(lambda: fs.put(str(local) + "/", remote + "/", recursive=True)))
                    times["raw_get"].append(timed(lambda: fs.get(remote + "/", str(dst) + "/", recursive=True)))
                    fs.rm(remote, recursive=True)
                    shutil.rmtree(dst)
            print(f"  repeat {rep}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        sync = statistics.median(timed(lambda: engine.policy.call("sync_rollout_weights")) for _ in range(3))
        print(f"  of a restore, the rollout copy's refresh from the shards (an all-gather): {sync:.2f} s")
        print()
        print(f"{'':10}{'store MB/s':>12}{'raw MB/s':>10}{'store/raw':>11}")
        for op, (ours, raw) in (("save", ("store_save", "raw_put")), ("restore", ("store_restore", "raw_get"))):
            print(f"{op:10}{mb / med[ours]:12.0f}{mb / med[raw]:10.0f}{med[raw] / med[ours]:10.2f}x")
    finally:
        if engine is not None:
            engine.stop()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
