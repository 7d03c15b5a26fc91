"""run.json is signed with the user's record key; a resume takes stored settings only from a signed record.

Whoever can write the bucket can rewrite run.json (docs/security.md). These tests tamper with it the way
such a writer would and check what `--resume` then does, in process (flows.plan.resume_config, the code
`rlflow train --resume` runs); tests/ops/test_bad_input.py does the same through the command line.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from engine.errors import ConfigError
from flows.config import load_config
from flows.plan import resolve_config, resume_config
from infra.errors import InfraError
from infra.record_key import ENV, FILE, existing_record_key, record_key, sign, verify
from infra.runs import RunStore
from infra.store import ObjectStore

MINE = "ab" * 32


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(ENV, MINE)
    return tmp_path / "runs"


def make_run(root: Path, run_id: str = "r1", *overrides: str) -> tuple[ObjectStore, Path]:
    """run.json as open_run writes it, for a config of the defaults plus `overrides`."""
    cfg = load_config(None, [f"storage.root={root}", *overrides])
    store = ObjectStore.from_config(cfg.storage)
    RunStore(store, run_id).write_run_info(cfg.public_dict(), code_version="test", config_hash=cfg.config_hash())
    return store, root / run_id / "run.json"


def tamper(path: Path, key: str, value: object) -> None:
    info = json.loads(path.read_text())
    node = info["config"]
    *sections, name = key.split(".")
    for part in sections:
        node = node[part]
    node[name] = value
    path.write_text(json.dumps(info))


def test_the_key_file_is_made_once_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("RLFLOW_HOME", str(tmp_path / "home"))
    assert existing_record_key() is None
    key = record_key()
    path = tmp_path / "home" / FILE
    assert key is not None and len(key) == 32 and bytes.fromhex(path.read_text()) == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert record_key() == key  # read back, not made again
    monkeypatch.setenv(ENV, "00ff")
    with pytest.raises(InfraError, match=r"RLFLOW_RECORD_KEY must be 64 or more hex digits"):
        record_key()


def test_a_signature_covers_every_field_and_the_run_id() -> None:
    key, other = bytes.fromhex(MINE), bytes(32)
    info = sign({"run_id": "a", "config": {"trainer": {"seed": 1}}, "parent": None}, "a", key)
    assert verify(info, "a", key) is None
    assert verify(info, "b", key) == "its signature does not match its contents"  # copied to another run
    assert verify(info, "a", other).startswith("it is signed with another key")
    assert verify(info, "a", None) == "there is no record key here to check its signature with"
    changed = json.loads(json.dumps(info))
    changed["config"]["trainer"]["seed"] = 2
    assert verify(changed, "a", key) == "its signature does not match its contents"
    changed = {k: v for k, v in info.items() if k != "signature"}
    assert verify(changed, "a", key) == "it is not signed"


# What a bucket writer put into an unsigned run.json on c4b7975, each accepted on `--resume` there: how the
# run's code is confined, where its data comes from, how much of the machine it takes, how it samples.
TAMPERED = {
    "reward.sandbox.isolation": "none",
    "reward.sandbox_timeout_s": 3600.0,
    "reward.sandbox_memory_mb": 1000000,
    "data.train_files": ["/etc/hostname"],
    "trainer.capacity_timeout_s": 1e9,
    "rollout.temperature": 1e-9,
    "rollout.multi_turn.env_memory_mb": 100000,
    "debug.kill_flow_after": "update_policy",
}


@pytest.mark.parametrize("key", list(TAMPERED))
def test_an_unsigned_run_json_decides_nothing(key: str, root: Path) -> None:
    store, path = make_run(root)
    tamper(path, key, TAMPERED[key])
    before = path.read_bytes()
    with pytest.raises(ConfigError) as err:
        resume_config(store, "r1", None, [f"storage.root={root}"])
    message = str(err.value)
    assert message.startswith(f"--resume r1: run.json has {key}={TAMPERED[key]!r} where your config and command "
                              "line give "), message
    assert "its signature does not match its contents" in message
    assert "\n" not in message and path.read_bytes() == before
    # The user's own value is theirs to give: the override wins and nothing of run.json's is asked for.
    given = load_config(None, []).model_dump(mode="json")
    *sections, name = key.split(".")
    for part in sections:
        given = given[part]
    text = given[name] if isinstance(given[name], str) else json.dumps(given[name])
    cfg = resume_config(store, "r1", None, [f"storage.root={root}", f"{key}={text}"])
    assert cfg.model_dump(mode="json") == load_config(None, [f"storage.root={root}", "trainer.run_id=r1"]
                                                      ).model_dump(mode="json")


def test_a_signed_run_json_is_the_users_own(root: Path) -> None:
    """A run started with settings of its own resumes with them from its signed run.json (as before)."""
    store, _ = make_run(root, "r1", "rollout.temperature=0.7", "trainer.capacity_timeout_s=60")
    cfg = resume_config(store, "r1", None, [f"storage.root={root}"])
    assert (cfg.rollout.temperature, cfg.trainer.capacity_timeout_s) == (0.7, 60.0)


def test_another_keys_run_json_decides_nothing(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ = make_run(root, "r1", "rollout.temperature=0.7")
    monkeypatch.setenv(ENV, "cd" * 32)  # another machine's key
    with pytest.raises(ConfigError, match=r"run.json has rollout.temperature=0.7 .* it is signed with another key"):
        resume_config(store, "r1", None, [f"storage.root={root}"])
    cfg = resume_config(store, "r1", load_config(None, [f"storage.root={root}", "rollout.temperature=0.7"]), [])
    assert cfg.rollout.temperature == 0.7  # with the config it began with, it resumes


def test_a_run_json_signed_for_another_run_decides_nothing(root: Path) -> None:
    store, _ = make_run(root, "other", "rollout.temperature=0.7")
    make_run(root, "r1")
    (root / "r1" / "run.json").write_bytes((root / "other" / "run.json").read_bytes().replace(b'"other"', b'"r1"'))
    with pytest.raises(ConfigError, match=r"run.json has rollout.temperature=0.7 .* does not match its contents"):
        resume_config(store, "r1", None, [f"storage.root={root}"])


def test_storage_is_where_the_user_found_the_run(root: Path, tmp_path: Path) -> None:
    """On c4b7975 run.json's storage.root (on S3 its endpoint_url) chose where the resumed run wrote."""
    store, path = make_run(root, "r1")
    for signed in (False, True):
        tamper(path, "storage.root", str(tmp_path / "attacker"))
        tamper(path, "storage.endpoint_url", "http://attacker.example:9000")
        if signed:  # even the user's own record: the storage is where they found the run
            path.write_text(json.dumps(sign(json.loads(path.read_text()), "r1", bytes.fromhex(MINE))))
        cfg, _ = resolve_config(None, [f"storage.root={root}"], "r1")  # what `rlflow train --resume r1` does
        assert (cfg.storage.root, cfg.storage.endpoint_url) == (str(root), None)


def test_an_unsigned_base_run_chooses_no_model_folder(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """A deployment's base checkpoint is merged into the model its run's run.json names: unsigned, that must
    be the model the user's config names (on c4b7975 any folder of this machine, read and exported into
    storage)."""
    from flows.deploy import BaseCheckpoint, base_model_dir

    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    store, path = make_run(root, "base")
    tamper(path, "model.path", str(tmp_path / "private-model"))
    user = load_config(None, [f"storage.root={root}"])
    with pytest.raises(ConfigError, match=r"its run's run.json has model.path='.*private-model' where your config "
                                          r"gives 'tiny', and its settings are not taken because its signature"):
        base_model_dir(BaseCheckpoint("base", 1, store.url("base/checkpoints/step_000001")), store, False, user)
