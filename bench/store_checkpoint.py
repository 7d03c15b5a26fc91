"""Benchmark: a ~200 MB checkpoint through the store vs raw s3fs put/get, on a local S3 server.

    python bench/store_checkpoint.py [--mb 200] [--shards 8] [--repeats 5]

A (store):  begin -> put_dir (parallel uploads, sha256 computed while uploading) -> trainer.json ->
            commit (MANIFEST from the hashes, LATEST, retention); read = fetch (parallel download,
            sha256 of every file checked against the manifest).
B (raw):    s3fs `put(local_dir, remote, recursive=True)` / `get(remote, local_dir, recursive=True)`
            of the same files, on the same endpoint, with s3fs/botocore defaults.
C (raw, no CRC): B with botocore's per-request CRC checksums off, as the store has them for
            checkpoint files (their sha256 in MANIFEST verifies them end to end instead): the
            like-for-like transfer baseline, to show what the store's own work costs.

The variants rotate (A B C, B C A, C A B, ...) so that drift of a shared machine hits all of them;
medians are reported, with MB/s and the ratio store/raw (goal: >= 0.8x). It starts its own S3 server
(python -m infra.s3server).
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

from infra.checkpoints import CheckpointStore  # noqa: E402
from infra.s3server import env_for  # noqa: E402
from infra.store import ObjectStore  # noqa: E402

BUCKET = "bench"


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "infra.s3server", "--port", "0", "--bucket", BUCKET],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("endpoint "):
            return proc, line.split()[1]
    raise RuntimeError("the S3 server did not start")


def make_shards(folder: Path, total_mb: int, shards: int) -> int:
    size = total_mb * 2**20 // shards
    for i in range(shards):
        (folder / f"__{i}_0.distcp").write_bytes(os.urandom(size))
    (folder / ".metadata").write_bytes(os.urandom(4096))
    return sum(p.stat().st_size for p in folder.iterdir())


def store_write(ckpts: CheckpointStore, step: int, src: Path) -> None:
    ckpts.begin(step)
    ckpts.put_dir(step, str(src), rel="policy")
    ckpts.write_trainer_state(step, {"iteration": step})
    ckpts.commit(step)


def store_read(ckpts: CheckpointStore, step: int, dst: Path) -> None:
    ckpts.fetch(step, str(dst))


def raw_write(fs, src: Path, remote: str) -> None:
    fs.put(str(src) + "/", remote + "/", recursive=True)


def raw_read(fs, remote: str, dst: Path) -> None:
    fs.get(remote + "/", str(dst) + "/", recursive=True)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    proc, endpoint = start_server()
    os.environ.update(env_for(endpoint))
    work = Path(tempfile.mkdtemp(prefix="rlflow-bench-"))
    try:
        import s3fs

        src = work / "src"
        src.mkdir()
        total = make_shards(src, args.mb, args.shards)
        mb = total / 2**20
        store = ObjectStore(f"s3://{BUCKET}/store")
        ckpts = CheckpointStore(store, "bench", keep_last=1)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
        fs_nocrc = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, config_kwargs={
            "request_checksum_calculation": "when_required", "response_checksum_validation": "when_required"})
        print(f"{mb:.0f} MB in {args.shards} shards + .metadata, {args.repeats} repeats, endpoint {endpoint}")

        kinds = ("store", "raw", "raw_nocrc")
        times: dict[str, list[float]] = {f"{k}_{op}": [] for k in kinds for op in ("write", "read")}
        store_write(ckpts, 0, src)  # warm-up: connections, imports
        raw_write(fs, src, f"{BUCKET}/raw/warm")
        raw_write(fs_nocrc, src, f"{BUCKET}/raw/warm")
        for rep in range(1, args.repeats + 1):
            order = kinds[rep % 3:] + kinds[:rep % 3]
            for kind in order:
                dst = work / f"out-{kind}-{rep}"
                if kind == "store":
                    times["store_write"].append(timed(lambda: store_write(ckpts, rep, src)))
                    times["store_read"].append(timed(lambda: store_read(ckpts, rep, dst)))
                else:
                    client = fs if kind == "raw" else fs_nocrc
                    remote = f"{BUCKET}/{kind}/{rep}"
                    times[f"{kind}_write"].append(timed(lambda: raw_write(client, src, remote)))
                    times[f"{kind}_read"].append(timed(lambda: raw_read(client, remote, dst)))
                    client.rm(remote, recursive=True)
                shutil.rmtree(dst)
            print(f"  repeat {rep}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)

        med = {k: statistics.median(v) for k, v in times.items()}
        print()
        header = f"{'':12}{'store MB/s':>12}{'raw MB/s':>10}{'store/raw':>11}{'raw-noCRC':>11}{'store/noCRC':>13}"
        print(header)
        for op in ("write", "read"):
            st, r, c = (mb / med[f"{k}_{op}"] for k in kinds)
            print(f"{op:12}{st:12.0f}{r:10.0f}{st / r:10.2f}x{c:11.0f}{st / c:12.2f}x")
        st, r, c = (2 * mb / (med[f"{k}_write"] + med[f"{k}_read"]) for k in kinds)
        print(f"{'write+read':12}{st:12.0f}{r:10.0f}{st / r:10.2f}x{c:11.0f}{st / c:12.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
