"""Checkpoints on both backends: a rank's DCP save into the staging location (engine/state/checkpoint_io.py,
hashed while written), commit, verified restore and fetch, fallback, retention, no unpickling."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch

from engine.state import checkpoint_io
from infra.checkpoints import HASH_DIR, CheckpointFallbackWarning, CheckpointStore
from infra.errors import IntegrityError, ObjectNotFound, StoreError
from infra.store import ObjectStore


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8, generator=g)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "extra": {"step": seed}}


def _zeros_like(state: dict) -> dict:
    def zero(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        return v
    return zero(state)


def _flip_byte(store: ObjectStore, key: str) -> None:
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    store.put_bytes(key, bytes(data))


def _write_policy(ckpts: CheckpointStore, step: int, state: dict) -> list[dict]:
    """One rank's save (no process group: a single-process DCP save), as the engine's ranks do it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp warns that no process group is initialised
        written = checkpoint_io.save(ckpts.step_url(step, "policy"), {"model": state["model"], "optim": state["optim"]},
                                     state["extra"], ckpts.store.storage_options(), rank=0)
    return [{**r, "path": f"policy/{r['path']}"} for r in written]


def _read_policy(url: str, state: dict, ckpts: CheckpointStore, expected: dict | None = None) -> dict:
    target = {"model": state["model"], "optim": state["optim"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint_io.load(url, target, ckpts.store.storage_options(), rank=0, expected=expected)


def _expected(manifest, role: str = "policy") -> dict:
    return {f.path[len(role) + 1:]: (f.size, f.sha256) for f in manifest.files if f.path.startswith(f"{role}/")}


def _save(ckpts: CheckpointStore, step: int, state: dict) -> None:
    ckpts.begin(step)
    written = _write_policy(ckpts, step, state)
    ckpts.write_trainer_state(step, {"iteration": step, "rng": [1, 2, 3]})
    ckpts.commit(step, written)


def _restore(ckpts: CheckpointStore, target: dict) -> int | None:
    def load(step, manifest):
        try:
            _read_policy(ckpts.step_url(step, "policy"), target, ckpts, _expected(manifest))
        except checkpoint_io.CheckpointCorruptError as err:
            raise IntegrityError(str(err)) from None
    return ckpts.restore(load)


def test_dcp_save_into_staging_and_load_back(store: ObjectStore, tmp_path, monkeypatch) -> None:
    ckpts = CheckpointStore(store, "run1")
    state = _state(3)
    staging = ckpts.begin(3)
    assert staging == store.url("run1/checkpoints/step_000003")
    written = _write_policy(ckpts, 3, state)
    ckpts.write_trainer_state(3, {"iteration": 3})
    assert ckpts.latest_committed() is None, "nothing is committed before commit()"
    # The ranks' records make the manifest: the commit reads no checkpoint file back.
    reads: list[str] = []
    original = ObjectStore.get_bytes
    monkeypatch.setattr(ObjectStore, "get_bytes", lambda self, key, **kw: reads.append(key) or original(self, key, **kw))
    manifest = ckpts.commit(3, written)
    monkeypatch.undo()
    assert not [k for k in reads if "/policy/" in k], reads

    paths = {f.path for f in manifest.files}
    assert {"policy/.metadata", "policy/extra_rank0.pt", "trainer.json"} <= paths
    assert any(p.endswith(".distcp") for p in paths)
    assert not any(p.startswith(HASH_DIR) for p in paths)
    for f in manifest.files:  # the hashes made while writing are the hashes of what is stored
        assert hashlib.sha256(store.get_bytes(f"run1/checkpoints/step_000003/{f.path}")).hexdigest() == f.sha256
    assert ckpts.latest_committed() == 3 and ckpts.latest_pointer() == 3
    assert store.get_bytes("run1/checkpoints/LATEST") == b"step_000003\n"

    loaded = ckpts.load_latest()
    assert loaded is not None and loaded.step == 3 and loaded.trainer_state == {"iteration": 3}
    target = _zeros_like(state)
    assert _restore(ckpts, target) == 3
    assert torch.equal(target["model"]["weight"], state["model"]["weight"])
    assert torch.equal(target["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])

    local = ckpts.load_latest(local_dir=str(tmp_path / "cache"))
    assert local is not None and local.url == str(tmp_path / "cache" / "step_000003")
    target = _zeros_like(state)
    extra = _read_policy(str(tmp_path / "cache" / "step_000003" / "policy"), target, ckpts)
    assert torch.equal(target["model"]["bias"], state["model"]["bias"]) and extra == {"step": 3}


def test_uncommitted_step_is_ignored_and_cleaned_by_begin(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, "run1")
    _save(ckpts, 1, _state(1))
    ckpts.begin(2)
    ckpts.write_bytes(2, "policy/__0_0.distcp", b"half a shard")  # the save crashed here
    assert ckpts.committed_steps() == [1] and ckpts.latest_committed() == 1
    assert ckpts.load_latest().step == 1
    ckpts.begin(2)  # a new attempt at step 2 starts clean
    assert store.list("run1/checkpoints/step_000002") == []


def test_begin_refuses_a_committed_step_unless_overwrite(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, "run1")
    _save(ckpts, 1, _state(1))
    with pytest.raises(StoreError, match="step_000001 is already committed"):
        ckpts.begin(1)
    store.delete("run1/checkpoints/LATEST")  # as if the first commit died right after MANIFEST
    assert ckpts.commit(1) == ckpts.read_manifest(1)  # a retried commit is a no-op...
    assert ckpts.latest_pointer() == 1  # ...that completes LATEST
    ckpts.begin(1, overwrite=True)
    assert ckpts.latest_committed() is None
    with pytest.raises(StoreError, match="nothing to commit"):
        ckpts.commit(1)


def test_flipped_byte_falls_back_with_a_warning_naming_the_file(store: ObjectStore, caplog) -> None:
    ckpts = CheckpointStore(store, "run1")
    _save(ckpts, 1, _state(1))
    _save(ckpts, 2, _state(2))
    shard = next(f.path for f in ckpts.read_manifest(2).files if f.path.endswith(".distcp"))
    _flip_byte(store, f"run1/checkpoints/step_000002/{shard}")

    with pytest.raises(IntegrityError, match=shard):
        ckpts.verify(2)
    with pytest.warns(CheckpointFallbackWarning, match=f"step 2 .*{shard}.*falling back to step 1"):
        loaded = ckpts.load_latest()
    assert loaded is not None and loaded.step == 1
    assert shard in caplog.text
    with pytest.warns(CheckpointFallbackWarning, match=shard):
        assert ckpts.resolve_loadable() == 1
    # Restoring reads each file once, verifying it as it is read: the flipped shard is caught there.
    target = _zeros_like(_state(1))
    with pytest.warns(CheckpointFallbackWarning, match=f"step 2 .*{shard.split('/')[-1]} is corrupt.*falling back"):
        assert _restore(ckpts, target) == 1
    assert torch.equal(target["model"]["weight"], _state(1)["model"]["weight"])


@pytest.mark.parametrize("listed", [[], [("x", b"x")]], ids=["no files", "a file the loader does not read"])
def test_a_fake_newest_step_falls_back_to_the_last_good_one(store: ObjectStore, listed: list) -> None:
    """A committed `step_99999999999` whose manifest vouches for nothing the loader reads: the restore
    through the ranks' reader (what `train --resume` does) falls back to step 1 with a warning, never a
    traceback; with no file listed, so does every reader (a commit never makes an empty manifest)."""
    ckpts = CheckpointStore(store, "run1")
    _save(ckpts, 1, _state(1))
    fake = "run1/checkpoints/step_99999999999"
    for path, data in listed:
        store.put_bytes(f"{fake}/{path}", data)
    files = [{"path": p, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for p, d in listed]
    store.put_bytes(f"{fake}/MANIFEST.json", json.dumps({"format": 1, "step": 99999999999, "created": "2026-12-07",
                                                         "total_bytes": sum(f["size"] for f in files),
                                                         "files": files}).encode())
    assert ckpts.latest_committed() == 99999999999
    target = _zeros_like(_state(1))
    with pytest.warns(CheckpointFallbackWarning, match="step 99999999999 .*falling back to step 1"):
        assert _restore(ckpts, target) == 1
    assert torch.equal(target["model"]["weight"], _state(1)["model"]["weight"])
    if not listed:
        with pytest.warns(CheckpointFallbackWarning, match="step 99999999999 .*files: List should have at least 1 item.*falling back to step 1"):
            assert ckpts.load_latest().step == 1


def test_missing_and_truncated_files_fail_verification(store: ObjectStore, tmp_path) -> None:
    ckpts = CheckpointStore(store, "run1", keep_last=5)
    for step in (1, 2):
        ckpts.begin(step)
        ckpts.write_bytes(step, "a.bin", b"a" * 1000)
        ckpts.write_bytes(step, "b.bin", b"b" * 1000)
        ckpts.commit(step)
    store.delete("run1/checkpoints/step_000001/a.bin")
    store.put_bytes("run1/checkpoints/step_000002/b.bin", b"b" * 999)
    with pytest.raises(IntegrityError, match="step_000001/a.bin is missing"):
        ckpts.verify(1)
    with pytest.raises(IntegrityError, match="step_000002/b.bin has 999 bytes"):
        ckpts.verify(2)
    with pytest.raises(IntegrityError, match="b.bin has 999 bytes"):
        ckpts.fetch(2, str(tmp_path / "x"))
    with pytest.warns(CheckpointFallbackWarning) as record:
        assert ckpts.load_latest() is None
    messages = [str(w.message) for w in record]
    assert "b.bin has 999 bytes" in messages[0] and "falling back to step 1" in messages[0]
    assert "a.bin is missing" in messages[1] and "no older committed checkpoint" in messages[1]
    with pytest.raises(ObjectNotFound, match="not committed"):
        ckpts.read_manifest(9)


def test_a_file_the_manifest_does_not_list_fails_verification(store: ObjectStore, tmp_path) -> None:
    """A committed step holds only what its manifest lists: a file planted after the commit (here a shard
    next to the real ones) makes the step fail verification, and the previous one is loaded; a hash record
    left by a crash between the commit and its removal is no such file."""
    ckpts = CheckpointStore(store, "run1")
    _save(ckpts, 1, _state(1))
    _save(ckpts, 2, _state(2))
    store.put_bytes(f"run1/checkpoints/step_000002/{HASH_DIR}/left.json", b'{"files": []}')
    ckpts.verify(2)
    store.put_bytes("run1/checkpoints/step_000002/policy/__9_0.distcp", b"planted")
    with pytest.raises(IntegrityError, match=r"step_000002/policy/__9_0.distcp is not in the manifest"):
        ckpts.verify(2)
    with pytest.raises(IntegrityError, match="is not in the manifest"):
        ckpts.fetch(2, str(tmp_path / "x"))
    with pytest.warns(CheckpointFallbackWarning, match="step 2 .*__9_0.distcp is not in the manifest.*falling back "
                                                       "to step 1"):
        loaded = ckpts.load_latest()
    assert loaded is not None and loaded.step == 1
    target = _zeros_like(_state(1))
    with pytest.warns(CheckpointFallbackWarning, match="is not in the manifest"):
        assert _restore(ckpts, target) == 1
    assert torch.equal(target["model"]["weight"], _state(1)["model"]["weight"])


def test_files_written_without_the_store_are_hashed_at_commit(store: ObjectStore, tmp_path) -> None:
    ckpts = CheckpointStore(store, "run1")
    ckpts.begin(5)
    store.put_bytes("run1/checkpoints/step_000005/raw.bin", b"written by someone else")
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "f.bin").write_bytes(b"f" * 5000)
    (tmp_path / "one.bin").write_bytes(b"1" * 100)
    ckpts.put_dir(5, str(tmp_path / "d"), rel="critic")
    ckpts.put_file(5, "one.bin", str(tmp_path / "one.bin"))
    manifest = ckpts.commit(5)
    by_path = {f.path: f for f in manifest.files}
    assert set(by_path) == {"raw.bin", "critic/sub/f.bin", "one.bin"}
    assert by_path["raw.bin"].sha256 == hashlib.sha256(b"written by someone else").hexdigest()
    assert manifest.total_bytes == 23 + 5000 + 100
    assert json.loads(store.get_bytes("run1/checkpoints/step_000005/MANIFEST.json"))["step"] == 5
    ckpts.verify(5)


def test_retention_keeps_last_k_and_every_m(store: ObjectStore) -> None:
    ckpts = CheckpointStore(store, "run1", keep_last=2, keep_every=4)
    for step in range(1, 10):
        ckpts.begin(step)
        ckpts.write_bytes(step, "shard", str(step).encode())
        ckpts.commit(step)
    assert ckpts.committed_steps() == [4, 8, 9]
    assert store.list("run1/checkpoints/step_000005") == []
    # An abandoned, uncommitted older step is tidied too; LATEST's step is never deleted.
    ckpts.begin(3)
    ckpts.write_bytes(3, "shard", b"crashed")
    store.put_bytes("run1/checkpoints/LATEST", b"step_000004\n")
    assert ckpts.apply_retention() == []
    assert store.list("run1/checkpoints/step_000003") == []
    assert ckpts.committed_steps() == [4, 8, 9]
    one = CheckpointStore(store, "run2", keep_last=1)
    for step in (1, 2):
        one.begin(step)
        one.write_bytes(step, "shard", b"x")
        one.commit(step)
    assert one.committed_steps() == [2] and one.latest_pointer() == 2


@pytest.mark.parametrize("victim", [".metadata", "__0_0.distcp"])
def test_pickles_in_a_checkpoint_run_nothing(store: ObjectStore, tmp_path, victim: str) -> None:
    """DCP's .metadata is a pickle, and its byte items (non-tensor state) are torch.load'ed: a crafted
    checkpoint (its manifest made to match, as whoever can write the bucket could) is refused and
    runs nothing."""
    import pickle

    class Payload:
        def __reduce__(self):  # noqa: ANN204 - what an attacker would write
            return (Path.touch, (tmp_path / "pwned",))

    ckpts = CheckpointStore(store, "run1")
    ckpts.begin(1)
    state = _state(1)
    if victim == "__0_0.distcp":  # a byte item whose pickle calls a function, written by DCP itself
        state["optim"] = {**state["optim"], "crafted": Payload()}
    written = _write_policy(ckpts, 1, state)
    if victim == ".metadata":
        crafted = pickle.dumps(Payload())
        store.put_bytes("run1/checkpoints/step_000001/policy/.metadata", crafted)
        written = [r if r["path"] != "policy/.metadata" else
                   {**r, "size": len(crafted), "sha256": hashlib.sha256(crafted).hexdigest()} for r in written]
    ckpts.commit(1, written)
    target = _zeros_like(_state(1))
    target["optim"] = {**target["optim"], "crafted": None}
    with pytest.raises(Exception, match="not a metadata type|Weights only load failed"):
        _read_policy(ckpts.step_url(1, "policy"), target, ckpts, _expected(ckpts.read_manifest(1)))
    assert not (tmp_path / "pwned").exists()


def _through_an_admitted_module(command: str) -> bytes:
    """A pickle that names os.system as an attribute of DCP's metadata module (which imports os), calls
    it with `command`: protocol 4's STACK_GLOBAL resolves a dotted name attribute by attribute."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()  # SHORT_BINUNICODE

    return (b"\x80\x04" + text("torch.distributed.checkpoint.metadata") + text("os.system") + b"\x93"
            + text(command) + b"\x85" + b"R" + b".")  # STACK_GLOBAL, TUPLE1, REDUCE, STOP


def _committed_with_crafted_metadata(store: ObjectStore, run_id: str, command: str) -> CheckpointStore:
    """Step 1 of `run_id` committed with its .metadata replaced by the crafted pickle and a manifest made to
    match (whoever writes the bucket rewrites MANIFEST.json too)."""
    ckpts = CheckpointStore(store, run_id)
    ckpts.begin(1)
    written = _write_policy(ckpts, 1, _state(1))
    crafted = _through_an_admitted_module(command)
    store.put_bytes(f"{run_id}/checkpoints/step_000001/policy/.metadata", crafted)
    ckpts.commit(1, [r if r["path"] != "policy/.metadata" else
                     {**r, "size": len(crafted), "sha256": hashlib.sha256(crafted).hexdigest()} for r in written])
    return ckpts


def test_metadata_cannot_reach_code_through_an_admitted_module(store: ObjectStore, tmp_path) -> None:
    """Whoever writes the bucket rewrites the manifest too: a .metadata that reaches os.system through the
    metadata module is refused, and the command never runs."""
    ckpts = _committed_with_crafted_metadata(store, "run1", f"touch {tmp_path / 'pwned'}")
    with pytest.raises(checkpoint_io.CheckpointCorruptError, match="os.system, which is not a metadata type"):
        _read_policy(ckpts.step_url(1, "policy"), _zeros_like(_state(1)), ckpts, _expected(ckpts.read_manifest(1)))
    assert not (tmp_path / "pwned").exists()


def test_an_enum_member_pickled_by_getattr_is_read_and_nothing_else_is() -> None:
    """Python 3.11.2 (Debian 12's python3) pickles an Enum member as getattr(class, name): the metadata of
    every checkpoint it writes holds _MEM_FORMAT_ENCODING that way. Refused, every restore of such a run fell
    back past all its checkpoints and replayed from iteration 1 (the fresh-clone suite of 2026-12-05 under
    /usr/bin/python3). getattr gives a member of an admitted Enum and nothing else."""
    import io

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    def pickled(module: bytes, name: bytes, attribute: bytes) -> bytes:  # protocol 2, as 3.11.2 writes it
        return (b"\x80\x02c__builtin__\ngetattr\nc" + module + b"\n" + name + b"\nX" + len(attribute).to_bytes(4, "little")
                + attribute + b"\x86R.")

    member = pickled(b"torch.distributed.checkpoint.metadata", b"_MEM_FORMAT_ENCODING", b"TORCH_CONTIGUOUS_FORMAT")
    assert checkpoint_io._MetadataUnpickler(io.BytesIO(member)).load() is _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    for module, name, attribute in [(b"pathlib", b"PosixPath", b"home"), (b"torch", b"Size", b"__class__"),
                                    (b"torch.distributed.checkpoint.metadata", b"_MEM_FORMAT_ENCODING", b"_missing_")]:
        with pytest.raises(checkpoint_io.CheckpointCorruptError, match="only a member of a metadata Enum"):
            checkpoint_io._MetadataUnpickler(io.BytesIO(pickled(module, name, attribute))).load()


def test_a_base_checkpoint_is_read_with_the_safe_reader(tiny_model_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduled lineage or a fresh run from a base checkpoint makes the base into a model folder
    (flows/deploy.py): its .metadata goes through the same allow-listed unpickler as a restore."""
    from flows.config import load_config
    from flows.deploy import BaseCheckpoint, base_model_dir
    from infra.runs import RunStore

    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    store = ObjectStore(str(tmp_path / "runs"))
    RunStore(store, "base").write_run_info(load_config(None, [f"model.path={tiny_model_dir}"]).public_dict())
    ckpts = _committed_with_crafted_metadata(store, "base", f"touch {tmp_path / 'pwned'}")
    with pytest.raises(checkpoint_io.CheckpointCorruptError, match="os.system, which is not a metadata type"):
        base_model_dir(BaseCheckpoint("base", 1, ckpts.step_url(1)), store)
    assert not (tmp_path / "pwned").exists()


def test_every_checkpoint_read_goes_through_the_safe_reader() -> None:
    """In the project's code (engine, flows, infra, tasks, bench): DCP readers, DCP loads, unpicklers and
    pickle loads exist only in engine/state/checkpoint_io.py (its allow-listed reader and planner), and every
    torch.load passes weights_only=True."""
    import ast

    repo = Path(__file__).resolve().parents[2]
    readers = {"FileSystemReader", "FsspecReader", "Unpickler", "_MetadataUnpickler"}
    found = []
    for folder in ("engine", "flows", "infra", "tasks", "bench"):
        for path in sorted((repo / folder).rglob("*.py")):
            rel = str(path.relative_to(repo))
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if not isinstance(node, ast.Call):
                    continue
                name = ast.unparse(node.func)
                last = name.rsplit(".", 1)[-1]
                if name.endswith("torch.load"):
                    weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                    if not (weights_only and isinstance(weights_only[0].value, ast.Constant)
                            and weights_only[0].value.value is True):
                        found.append(f"{rel}:{node.lineno} {name} without weights_only=True")
                elif (last in readers or name in ("dcp.load", "pickle.load", "pickle.loads")
                      or name.endswith("checkpoint.load")) and rel != "engine/state/checkpoint_io.py":
                    found.append(f"{rel}:{node.lineno} {name}")
    assert not found, found


def test_a_base_run_json_does_not_choose_trust_remote_code(tiny_model_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.errors import ConfigError
    from flows.config import load_config
    from flows.deploy import BaseCheckpoint, base_model_dir
    from infra.runs import RunStore

    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    store = ObjectStore(str(tmp_path / "runs"))
    config = load_config(None, [f"model.path={tiny_model_dir}"]).public_dict()
    config["model"]["trust_remote_code"] = True  # written by whoever can write the bucket
    RunStore(store, "base").write_run_info(config)
    with pytest.raises(ConfigError, match="run.json has model.trust_remote_code=True where your config gives False"):
        base_model_dir(BaseCheckpoint("base", 1, store.url("base/checkpoints/step_000001")), store)
