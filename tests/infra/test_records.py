"""Every stored record a run or `rlflow runs show` reads back is parsed by a total function (infra/records.py):
bad bytes give one CorruptRecordError naming the object, never another exception; a bad newest checkpoint
falls back to the one before."""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flows.cli import main
from infra.buffers import load_ref
from infra.checkpoints import CheckpointFallbackWarning, CheckpointStore
from infra.errors import CorruptRecordError, IntegrityError
from infra.runs import RunStore
from infra.store import ObjectStore

HUGE = 10**30
# Bytes no rlflow writer makes, whatever the record: each must be refused as corrupt.
ANY_RECORD = {
    "not utf-8": b'{"a": "\xff\xfe"}',
    "utf-16": '{"run_id": "run1"}'.encode("utf-16"),
    "truncated": b'{"run_id": ',
    "not an object": b"[1, 2]",
    "100k deep": b"[" * 100_000 + b"]" * 100_000,
    "5000 digits": b'{"a": 1' + b"0" * 5000 + b"}",
    "lone surrogate": b'{"a": "\\ud800"}',
    "empty": b"",
}
GOOD_RUN = {"run_id": "run1", "created": "2026-12-07T03:00:00+00:00", "config": {"model": {"path": "tiny"}},
            "code_version": "abc", "parent": None, "config_hash": "f" * 16, "base_model": None}
GOOD_LEASE = {"run_id": "run1", "token": "t" * 32, "host": "h", "pid": 1, "since": "s", "renewed": "r",
              "expires_at": 1.0, "expires": "e", "generation": 1, "released": True}
GOOD_REF = {"uri": "file:///x", "sha256": "0" * 64, "rows": 4, "columns": ["advantages"]}
GOOD_METRICS = {"iteration": 1, "actor/pg_loss": 0.5}
GOOD_TRAINER = {"iteration": 1, "kl_ctrl": {"value": 0.001}}
# Per record: changes of one field (None: remove it) that a writer of ours never makes.
FIELDS: dict[str, list[dict[str, Any]]] = {
    "run.json": [{"created": 5}, {"config": []}, {"config": {"model": "tiny"}},
                 {"parent": {"run_id": "a", "step": "7", "checkpoint": "c"}},
                 {"parent": {"run_id": "a", "step": HUGE, "checkpoint": "c"}}, {"parent": "run0"},
                 {"base_model": {"path": "p", "sha256": 7}}, {"run_id": None}, {"created": float("nan")}],
    "lock.json": [{"pid": HUGE}, {"pid": "1"}, {"expires_at": "soon"}, {"expires_at": float("inf")},
                  {"generation": "2"}, {"generation": -1}, {"released": "no"}, {"token": None}, {"host": ["h"]}],
    "ref.json": [{"rows": -1}, {"rows": HUGE}, {"rows": 4.0}, {"columns": "advantages"}, {"sha256": 5},
                 {"sha256": "zz"}, {"uri": None}],
    "metrics": [{"iteration": "1"}, {"iteration": 2}, {"iteration": None}, {"actor/pg_loss": "0.5"},
                {"actor/pg_loss": [1]}, {"x": HUGE}],
    "trainer.json": [{"kl_ctrl": {"value": float("nan")}}, {"kl_ctrl": {"value": "0.1"}}, {"kl_ctrl": [0.1]},
                     {"kl_ctrl": {"value": 1e300}}, {"iteration": HUGE}, {"iteration": 2}, {"iteration": None}],
}


def _edit(good: dict[str, Any], change: dict[str, Any]) -> bytes:
    record = dict(good)
    for key, value in change.items():
        if value is None and key in good:
            record.pop(key)
        else:
            record[key] = value
    return json.dumps(record).encode()


def _cases(kind: str, good: dict[str, Any]) -> list[Any]:
    return ([pytest.param(data, id=f"{kind}-{name}") for name, data in ANY_RECORD.items()]
            + [pytest.param(_edit(good, change), id=f"{kind}-{json.dumps(change)[:40]}") for change in FIELDS[kind]])


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(str(tmp_path / "runs"))


def _refused(read: Callable[[], Any], url: str) -> None:
    with pytest.raises(CorruptRecordError) as info:
        read()
    message = str(info.value)
    assert url in message and "\n" not in message, message


@pytest.mark.parametrize("data", _cases("run.json", GOOD_RUN))
def test_run_json(store: ObjectStore, data: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    runs = RunStore(store, "run1")
    store.put_bytes("run1/run.json", data)
    _refused(runs.read_run_info, runs.url("run.json"))
    _refused(runs.summary, runs.url("run.json"))
    _one_line_from_runs_show(store, runs.url("run.json"), capsys)


@pytest.mark.parametrize("data", _cases("lock.json", GOOD_LEASE))
def test_lock_json(store: ObjectStore, data: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    runs = RunStore(store, "run1")
    store.put_bytes("run1/run.json", json.dumps(GOOD_RUN).encode())
    store.put_bytes("run1/lock.json", data)
    _refused(runs.lease_holder, runs.url("lock.json"))
    _refused(lambda: runs.acquire_lease(ttl_s=60), runs.url("lock.json"))  # what `train --resume` does first
    _one_line_from_runs_show(store, runs.url("lock.json"), capsys)


def _one_line_from_runs_show(store: ObjectStore, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", "show", "run1", "--root", store.root]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlflow: error: ") and err.count("\n") == 1 and url in err, err


@pytest.mark.parametrize("data", _cases("ref.json", GOOD_REF))
def test_buffer_ref(store: ObjectStore, data: bytes) -> None:
    store.put_bytes("run1/buffers/iter_000001/advantage.ref.json", data)
    _refused(lambda: load_ref(store, "run1", 1, "advantage"), store.url("run1/buffers/iter_000001/advantage.ref.json"))


@pytest.mark.parametrize("data", _cases("metrics", GOOD_METRICS))
def test_metrics(store: ObjectStore, data: bytes) -> None:
    runs = RunStore(store, "run1")
    store.put_bytes("run1/metrics/iter_000001.json", data)
    _refused(runs.read_metrics, runs.url("metrics/iter_000001.json"))


def _commit_step(store: ObjectStore, step: int, trainer: bytes) -> CheckpointStore:
    ckpts = CheckpointStore(store, "run1", keep_last=5)
    ckpts.begin(step)
    ckpts.write_bytes(step, "policy/shard.bin", b"w" * 100)
    ckpts.write_bytes(step, "trainer.json", trainer)
    ckpts.commit(step)
    return ckpts


@pytest.mark.parametrize("data", _cases("trainer.json", GOOD_TRAINER))
def test_trainer_json_that_its_manifest_vouches_for(store: ObjectStore, data: bytes) -> None:
    """Written and committed as is (the manifest hashes it): the parse still refuses it."""
    ckpts = _commit_step(store, 1, data)
    _refused(lambda: ckpts.read_trainer_state(1), ckpts.step_url(1, "trainer.json"))


def test_an_edited_trainer_json_fails_its_manifest(store: ObjectStore) -> None:
    """The issue's case: NaN put into the KL state with MANIFEST untouched."""
    ckpts = _commit_step(store, 1, json.dumps(GOOD_TRAINER).encode())
    assert ckpts.read_trainer_state(1) == GOOD_TRAINER
    edited = json.dumps({**GOOD_TRAINER, "kl_ctrl": {"value": float("nan")}}).encode()
    store.put_bytes("run1/checkpoints/step_000001/trainer.json", edited)
    with pytest.raises(IntegrityError, match=r"step_000001/trainer.json (is corrupt|has \d+ bytes)"):
        ckpts.read_trainer_state(1)


BAD_MANIFESTS = {
    "no files": {"files": []},
    "another step": {"step": 3},
    "a path out of the folder": {"files": [{"path": "../../../x", "size": 1, "sha256": "0" * 64}], "total_bytes": 1},
    "a negative size": {"files": [{"path": "x", "size": -1, "sha256": "0" * 64}], "total_bytes": -1},
    "a wrong total": {"total_bytes": 5},
    "a huge step": {"step": HUGE},
    "a string size": {"files": [{"path": "x", "size": "1", "sha256": "0" * 64}], "total_bytes": 1},
}


@pytest.mark.parametrize("change", [pytest.param(v, id=k) for k, v in BAD_MANIFESTS.items()]
                         + [pytest.param(v, id=k) for k, v in ANY_RECORD.items()])
def test_a_bad_manifest_is_corrupt_and_falls_back(store: ObjectStore, change: dict[str, Any] | bytes) -> None:
    ckpts = _commit_step(store, 1, json.dumps(GOOD_TRAINER).encode())
    good = {"format": 1, "step": 2, "created": "2026-12-07T03:00:00+00:00", "total_bytes": 1,
            "files": [{"path": "x", "size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}]}
    store.put_bytes("run1/checkpoints/step_000002/x", b"x")
    data = change if isinstance(change, bytes) else _edit(good, change)
    store.put_bytes("run1/checkpoints/step_000002/MANIFEST.json", data)
    _refused(lambda: ckpts.read_manifest(2), ckpts.step_url(2, "MANIFEST.json"))
    with pytest.warns(CheckpointFallbackWarning, match="step 2 .*falling back to step 1"):
        loaded = ckpts.load_latest()
    assert loaded is not None and loaded.step == 1 and loaded.trainer_state == GOOD_TRAINER


@pytest.mark.parametrize("data", [b"\xff\xfe", b"step_1x\n", b"[]", b"step_" + b"9" * 5000])
def test_a_bad_latest_pointer_is_ignored_with_a_warning(store: ObjectStore, data: bytes,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    ckpts = _commit_step(store, 1, json.dumps(GOOD_TRAINER).encode())
    store.put_bytes("run1/checkpoints/LATEST", data)
    with caplog.at_level(logging.WARNING, logger="rlflow.storage"):
        assert ckpts.latest_pointer() is None
    assert "LATEST does not name a step" in caplog.text
    assert ckpts.latest_committed() == 1  # the MANIFESTs decide, as before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpts.load_latest() is not None


def test_a_planted_hash_record_is_ignored_and_the_file_hashed_from_storage(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, "run1")
    ckpts.begin(1)
    ckpts.write_bytes(1, "a.bin", b"a" * 10)
    store.put_bytes("run1/checkpoints/step_000001/.sha256/planted.json", b'{"files": [{"path": 5}]}')
    manifest = ckpts.commit(1)
    assert [(f.path, f.sha256) for f in manifest.files] == [("a.bin", hashlib.sha256(b"a" * 10).hexdigest())]


def test_the_kl_controller_is_restored_from_verified_records_only(store: ObjectStore, caplog) -> None:
    """flows/train.py _restore_kl on a resume: trainer.json of the newest checkpoint, then the KL each later
    advantage buffer recorded. An edited trainer.json (NaN, MANIFEST untouched) is skipped with a warning
    and the controller is rebuilt from the buffers; a buffer recording a NaN KL is refused."""
    from types import SimpleNamespace

    import torch

    from engine.advantage import make_kl_controller
    from engine.batch import Batch
    from flows.config import load_config
    from flows.train import _restore_kl
    from infra.buffers import write_buffer

    cfg = load_config(None, ["algorithm.kl_ctrl=adaptive", "algorithm.use_kl_in_reward=true"])
    runs = RunStore(store, "run1")
    kls = {1: 0.5, 2: 0.01}
    for iteration, kl in kls.items():
        runs.write_metrics(iteration, {"actor/pg_loss": 0.0})
        write_buffer(store, "run1", iteration, "advantage",
                     Batch({"advantages": torch.zeros(2, 3)}, {}, {"metrics": {"actor/reward_kl_penalty": kl}}))
    ckpts = _commit_step(store, 1, json.dumps({"iteration": 1, "kl_ctrl": {"value": 0.5}}).encode())
    trainer = SimpleNamespace(cfg=cfg, kl=None, run=SimpleNamespace(runs=runs, store=store),
                              plan=SimpleNamespace(run_id="run1"))
    n = cfg.data.train_batch_size * cfg.rollout.n

    def expected(start: float | None, iterations: list[int]) -> float:
        ctrl = make_kl_controller(cfg.algorithm)
        if start is not None:
            ctrl.load_state_dict({"value": start})
        for i in iterations:
            ctrl.update(kls[i], n_steps=n)
        return ctrl.value

    _restore_kl(trainer)
    assert trainer.kl.value == expected(0.5, [2])

    # NaN for 0.5: the same size, so only the hash tells
    store.put_bytes(ckpts.step_key(1, "trainer.json"), json.dumps({"iteration": 1, "kl_ctrl": {"value": float("nan")}}
                                                                  ).encode())
    logging.getLogger("rlflow.train").addHandler(caplog.handler)
    try:
        _restore_kl(trainer)
    finally:
        logging.getLogger("rlflow.train").removeHandler(caplog.handler)
    assert trainer.kl.value == expected(None, [1, 2])
    assert "step_000001/trainer.json is corrupt: sha256" in caplog.text

    write_buffer(store, "run1", 2, "advantage",
                 Batch({"advantages": torch.zeros(2, 3)}, {}, {"metrics": {"actor/reward_kl_penalty": float("nan")}}))
    with pytest.raises(CorruptRecordError, match="advantage.parquet records actor/reward_kl_penalty=nan"):
        _restore_kl(trainer)


@pytest.mark.parametrize("metrics", [{"sampling/next_step": float("nan")}, {"sampling/next_step": "12"}, {}, [1]],
                         ids=["nan", "a string", "missing", "not a dict"])
def test_what_a_stage_reads_from_the_previous_buffer_is_checked(store: ObjectStore, metrics: Any) -> None:
    """tasks/stages.py recorded_before: the sampler step (dynamic sampling) and safe RL's multiplier come from
    the previous iteration's buffer record, a number or one CorruptRecordError naming the buffer."""
    from types import SimpleNamespace

    import torch

    from engine.batch import Batch
    from infra.buffers import write_buffer
    from tasks.stages import recorded_before

    write_buffer(store, "run1", 1, "rollout", Batch({"responses": torch.zeros(2, 3)}, {}, {"metrics": metrics}))
    ctx = SimpleNamespace(store=store, plan=SimpleNamespace(run_id="run1"))
    with pytest.raises(CorruptRecordError, match=r"iter_000001/rollout.parquet records sampling/next_step=.*dynamic"):
        recorded_before(ctx, 2, "rollout", "sampling/next_step", "dynamic sampling")
    write_buffer(store, "run1", 1, "rollout", Batch({"responses": torch.zeros(2, 3)}, {},
                                                    {"metrics": {"sampling/next_step": 12}}))
    assert recorded_before(ctx, 2, "rollout", "sampling/next_step", "dynamic sampling") == 12.0


def test_runs_show_prints_stored_text_as_text(store: ObjectStore, capsys: pytest.CaptureFixture[str]) -> None:
    """Strings of run.json and lock.json are shown as they are: rich markup in them is not markup ("[/x]" was
    a MarkupError traceback) and a terminal escape is not sent to the terminal."""
    store.put_bytes("run1/run.json", _edit(GOOD_RUN, {"created": "[/x] \x1b[31mred", "code_version": "[bold]v",
                                                      "parent": {"run_id": "[/p]", "step": 3, "checkpoint": "c"}}))
    store.put_bytes("run1/lock.json", _edit(GOOD_LEASE, {"host": "[/h]"}))
    for verb in (["show", "run1"], ["list"]):
        assert main(["runs", *verb, "--root", store.root]) == 0
        out = capsys.readouterr().out
        assert "[/x]" in out and "\x1b" not in out, out
    assert main(["runs", "show", "run1", "--root", store.root]) == 0
    out = capsys.readouterr().out
    assert "[bold]v" in out and "[/p] step 3" in out and "host [/h]" in out, out
