"""Run layout on both backends: run.json, the writer lease, metrics, summary and the CLI."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from flows.config import load_config
from infra.errors import LeaseError, StoreError
from infra.runs import Lease, RunStore, find_secret_keys, list_runs
from infra.store import ObjectStore


def test_run_json_holds_the_public_config_only(store: ObjectStore) -> None:
    cfg = load_config(None, ["storage.root=s3://bucket/runs", "storage.access_key_id=AKIAEXAMPLE",
                             "storage.secret_access_key=hunter2"])
    run = RunStore(store, "run1")
    run.write_run_info(cfg.public_dict(), code_version="abc123", parent={"run_id": "run0", "step": 20,
                                                                  "checkpoint": "s3://b/run0/checkpoints/step_000020"})
    raw = store.get_bytes("run1/run.json")
    assert b"hunter2" not in raw and b"AKIAEXAMPLE" not in raw
    info = run.read_run_info()
    assert info["config"]["actor"] == cfg.public_dict()["actor"] and info["parent"]["step"] == 20
    with pytest.raises(StoreError, match=r"storage\.secret_access_key"):
        run.write_run_info(cfg.model_dump(mode="json"))
    assert find_secret_keys({"a": [{"api_key": 1}], "tokenizer_path": "x", "max_new_tokens": 3}) == ["a[0].api_key"]


def test_a_second_writer_is_refused_naming_the_holder(store: ObjectStore) -> None:
    run = RunStore(store, "run1")
    first = run.acquire_lease(ttl_s=60)
    with pytest.raises(LeaseError) as info:
        run.acquire_lease(ttl_s=60)
    message = str(info.value)
    assert f"host {socket.gethostname()}" in message and f"pid {os.getpid()}" in message
    assert f"since {first.record['since']}" in message and "run1/lock.json" in message
    first.release()
    second = run.acquire_lease(ttl_s=60)  # a released lease is free at once
    assert second.record["generation"] == first.record["generation"] + 1
    second.release()


def test_renewal_extends_and_an_expired_lease_is_taken_over(store: ObjectStore) -> None:
    run = RunStore(store, "run1")
    old = run.acquire_lease(ttl_s=0.5)
    expires = old.record["expires_at"]
    old.renew()
    assert old.record["expires_at"] > expires
    time.sleep(0.7)
    new = run.acquire_lease(ttl_s=60)  # expired: taken over
    assert new.record["token"] != old.token
    with pytest.raises(LeaseError, match="lost the lease.*taken over by host"):
        old.renew()
    old.release()  # no error: it is no longer ours, and the new holder keeps it
    assert run.lease_holder()["token"] == new.token
    with new:
        pass
    assert run.lease_holder()["released"] is True


def test_background_renewal(store: ObjectStore) -> None:
    run = RunStore(store, "run1")
    lease = run.acquire_lease(ttl_s=0.6)
    lease.start_renewing(every_s=0.1)
    time.sleep(1.0)
    with pytest.raises(LeaseError):
        run.acquire_lease(ttl_s=60)  # still held thanks to renewal
    lease.check()
    lease.release()
    assert run.lease_holder()["released"] is True


def test_a_lost_create_response_is_recognised(store: ObjectStore) -> None:
    # Simulates a retried conditional create whose first try landed: the record holds our token.
    lease = Lease(store, "run1", ttl_s=60)
    store.put_bytes("run1/lock.json", json.dumps(lease._new_record(generation=1)).encode())
    assert lease.acquire().record["token"] == lease.token


def test_metrics_are_one_object_per_iteration(store: ObjectStore) -> None:
    run = RunStore(store, "run1")
    assert run.last_finished_iteration() is None and run.read_metrics() == []
    for i in (2, 0, 1):
        run.write_metrics(i, {"actor/pg_loss": 0.1 * i, "timing_s/step": 1.0})
    run.write_metrics(1, {"actor/pg_loss": 0.5, "timing_s/step": 1.0})  # a redone iteration replaces
    assert run.last_finished_iteration() == 2 and run.finished_iterations() == [0, 1, 2]
    lines = run.metrics_jsonl().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [0, 1, 2]
    assert json.loads(lines[1])["actor/pg_loss"] == 0.5
    assert store.exists("run1/metrics/iter_000001.json")


def test_summary_and_listing(store: ObjectStore) -> None:
    run = RunStore(store, "run1")
    run.write_run_info({"trainer": {"total_iterations": 3}})
    run.write_metrics(0, {"x": 1})
    store.put_bytes(run.buffer_key(0, "rollout"), b"p" * 100)
    store.put_bytes(run.buffer_key(0, "reward"), b"p" * 50)
    ckpts = run.checkpoints()
    ckpts.begin(0)
    ckpts.write_bytes(0, "policy/shard", b"s" * 10)
    ckpts.commit(0)
    ckpts.begin(1)
    ckpts.write_bytes(1, "policy/shard", b"s" * 10)  # never committed
    store.put_bytes(run.export_key(0) + "/config.json", b"{}")
    lease = run.acquire_lease()
    RunStore(store, "run2").write_run_info({})
    store.put_bytes("not-a-run/file", b"x")

    s = run.summary()
    assert (s.iterations_done, s.last_iteration, s.latest_checkpoint) == (1, 0, 0)
    assert s.checkpoints == [0] and s.uncommitted_checkpoints == [1] and s.exports == [0]
    assert [(b.iteration, b.name, b.size) for b in s.buffers] == [(0, "reward", 50), (0, "rollout", 100)]
    assert s.bytes_total == store.du("run1") and s.created is not None
    assert s.lease is not None and "pid" in s.lease
    assert list_runs(store) == ["run1", "run2"]
    assert run.export_url(20).endswith("run1/export/step_000020")
    lease.release()


def test_cli_runs_list_and_show(store: ObjectStore, capsys) -> None:
    from flows.cli import main

    run = RunStore(store, "run7")
    run.write_run_info({})
    run.write_metrics(0, {"x": 1})
    store.put_bytes(run.buffer_key(0, "rollout"), b"p" * 2048)
    assert main(["runs", "list", "--root", store.root]) == 0
    out = capsys.readouterr().out
    assert "run7" in out
    assert main(["runs", "show", "run7", "--root", store.root]) == 0
    out = capsys.readouterr().out
    assert "iterations done" in out and "rollout" in out and "KiB" in out
    assert main(["runs", "show", "missing", "--root", store.root]) == 2
    assert "no run 'missing'" in capsys.readouterr().err


def test_cli_registers_infra_s3() -> None:
    from flows.cli import build_parser

    args = build_parser().parse_args(["infra", "s3", "--port", "0", "--bucket", "b"])
    assert (args.port, args.bucket) == (0, "b") and callable(args.func)


def test_cli_runs_list_of_a_missing_root_is_an_error(tmp_path, capsys) -> None:
    from flows.cli import main

    assert main(["runs", "list", "--root", str(tmp_path / "nonexistent")]) == 2
    assert capsys.readouterr().err == f"rlflow: error: storage root '{tmp_path / 'nonexistent'}' is not a folder\n"
