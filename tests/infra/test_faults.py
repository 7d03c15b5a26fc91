"""Fault tests: a writer killed mid-checkpoint, S3 down for 5 s mid-write, a hung S3, lease races.

(The flipped-byte fallback is in test_checkpoints.py, the fail-fast permanent errors and throttling
in test_store.py.)

The S3 outage is made with a TCP proxy in front of the session's S3 server (tcp_proxy.py, its own
process): killing the proxy resets the open connections and refuses new ones, exactly what clients
see when an S3 endpoint goes down, while the server behind it keeps its buckets and objects — moto
keeps state only in memory, so killing and restarting moto itself would lose the bucket and test a
different thing (data loss). Restarting the proxy on the same port brings the endpoint back.
SIGSTOP on the proxy simulates a hung server (connections accepted, nothing answered).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from storage_helpers import ProxyProcess

from engine.batch import Batch
from infra.buffers import read_buffer, write_buffer
from infra.checkpoints import CheckpointStore
from infra.errors import StoreError
from infra.runs import RunStore
from infra.store import ObjectStore

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def _script(name: str, *args: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(HERE / name), *map(str, args)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_writer_killed_mid_checkpoint_leaves_latest_loadable(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, "run1")
    ckpts.begin(1)
    ckpts.write_bytes(1, "policy/__0_0.distcp", b"step one" * 1000)
    ckpts.commit(1)

    writer = _script("slow_checkpoint_writer.py", store.root, "run1", 2, 40, 512 * 1024, 0.05)
    assert writer.stdout is not None
    for line in writer.stdout:
        if line.startswith("shard 4"):
            break
    else:
        raise AssertionError(f"the writer did not get going (exit {writer.wait()})")
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()

    assert ckpts.latest_pointer() == 1 and ckpts.latest_committed() == 1
    assert len(store.list("run1/checkpoints/step_000002")) >= 5  # the half-written step is there...
    loaded = ckpts.load_latest()  # ...and ignored
    assert loaded is not None and loaded.step == 1
    assert RunStore(store, "run1").summary().uncommitted_checkpoints == [2]
    ckpts.begin(2)
    ckpts.write_bytes(2, "policy/__0_0.distcp", b"step two")
    ckpts.commit(2)
    assert ckpts.load_latest().step == 2


def test_a_crash_just_before_the_manifest_keeps_the_previous_step(store: ObjectStore, monkeypatch) -> None:
    ckpts = CheckpointStore(store, "run1")
    for step in (1, 2):
        ckpts.begin(step)
        ckpts.write_bytes(step, "shard", b"data %d" % step)
    ckpts.commit(1)
    real = store.put_bytes

    def crash_on_manifest(key: str, data: bytes) -> None:
        if key.endswith("MANIFEST.json"):
            raise KeyboardInterrupt("killed")
        real(key, data)

    monkeypatch.setattr(store, "put_bytes", crash_on_manifest)
    with pytest.raises(KeyboardInterrupt):
        ckpts.commit(2)
    monkeypatch.undo()
    assert ckpts.latest_committed() == 1 and ckpts.latest_pointer() == 1


def _big_batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch(tensors={"old_logp": torch.randn(1000, 1000, generator=g)},  # 4 MB, incompressible
                 columns={"uid": list(range(1000))}, meta={"iteration": 7})


@pytest.mark.slow
def test_s3_down_for_5s_during_a_buffer_write_then_back(s3_proxy: ProxyProcess, caplog) -> None:
    s3_proxy.start("--rate", "1500000")  # ~3 s for the upload: it is surely in flight when killed
    store = ObjectStore("s3://rlflow-test/outage", endpoint_url=s3_proxy.endpoint_url,
                        connect_timeout_s=1.0, read_timeout_s=5.0)  # default retries: 8 tries, <= 8 s waits
    batch = _big_batch()
    result: dict = {}

    def write() -> None:
        try:
            result["ref"] = write_buffer(store, "run1", 7, "advantage", batch)
        except Exception as err:  # noqa: BLE001 - reported by the assertions below
            result["error"] = err

    writer = threading.Thread(target=write)
    writer.start()
    s3_proxy.wait_for_upload(500_000)  # half a MB of the object has gone out
    s3_proxy.kill()  # S3 is down: connections reset, new ones refused
    time.sleep(5.0)
    assert writer.is_alive(), f"the write gave up while S3 was down: {result}"
    s3_proxy.start()  # back on the same port
    writer.join(60)
    assert "error" not in result, result.get("error")
    assert read_buffer(store, result["ref"]) == batch
    assert "retry" in caplog.text


@pytest.mark.slow
def test_a_hung_s3_server_becomes_a_retry(s3_proxy: ProxyProcess) -> None:
    s3_proxy.start()
    store = ObjectStore("s3://rlflow-test/hung", endpoint_url=s3_proxy.endpoint_url, connect_timeout_s=1.0,
                        read_timeout_s=1.0, retry_attempts=10, retry_max_wait_s=1.0)
    store.put_bytes("k", b"value")
    s3_proxy.signal(signal.SIGSTOP)  # accepts connections (kernel backlog), answers nothing
    result: dict = {}
    reader = threading.Thread(target=lambda: result.update(value=store.get_bytes("k")))
    start = time.monotonic()
    reader.start()
    time.sleep(3.0)
    assert reader.is_alive()
    s3_proxy.signal(signal.SIGCONT)
    reader.join(30)
    assert result.get("value") == b"value" and time.monotonic() - start >= 3.0


@pytest.mark.slow
def test_a_hung_server_without_retries_left_fails_in_bounded_time(s3_proxy: ProxyProcess) -> None:
    s3_proxy.start()
    store = ObjectStore("s3://rlflow-test/hung2", endpoint_url=s3_proxy.endpoint_url, connect_timeout_s=0.5,
                        read_timeout_s=0.5, retry_attempts=2, retry_max_wait_s=0.1)
    s3_proxy.signal(signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(StoreError, match="failed after 2 tries"):
        store.get_bytes("k")
    assert time.monotonic() - start < 5.0
    s3_proxy.signal(signal.SIGCONT)


def test_two_processes_racing_for_the_lease_exactly_one_wins(store: ObjectStore) -> None:
    rounds = 6
    # Odd rounds race to take over an EXPIRED lease (conditional replace), even rounds to create one.
    for r in range(1, rounds, 2):
        lease = RunStore(store, f"race-{r}").acquire_lease(ttl_s=0.01)
        lease.stop_renewing()
    time.sleep(0.05)
    t0 = time.time() + 3.0  # both processes are up and waiting by then
    racers = [_script("lease_racer.py", store.root, "race", rounds, t0, 0.3) for _ in range(2)]
    outputs = [p.communicate(timeout=60)[0] for p in racers]
    results: dict[int, list[str]] = {}
    for out in outputs:
        for line in out.splitlines():
            r, verdict = line.split()[:2]
            results.setdefault(int(r), []).append(verdict)
    assert sorted(results) == list(range(rounds)), outputs
    for r, verdicts in results.items():
        assert sorted(verdicts) == ["refused", "won"], (r, outputs)
    refusal = next(line for out in outputs for line in out.splitlines() if "refused" in line)
    assert "already has a writer: host" in refusal and "pid" in refusal and "since" in refusal
