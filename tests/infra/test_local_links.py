"""A local storage root: whoever can write it cannot send a write (or a read) outside it through a link.

On c4b7975 a link named `metrics` (or `export`) inside a run's folder made the run write its metrics (its
export) wherever the link pointed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra.errors import StoreError
from infra.runs import RunStore
from infra.store import ObjectStore


@pytest.mark.parametrize("name", ["metrics", "export", "buffers"])
def test_a_link_inside_the_root_is_not_followed(name: str, tmp_path: Path) -> None:
    root, outside = tmp_path / "runs", tmp_path / "outside"
    (root / "r1").mkdir(parents=True)
    outside.mkdir()
    (outside / "iter_000001.json").write_text("theirs")
    (root / "r1" / name).symlink_to(outside)
    store = ObjectStore(str(root))
    for write in (lambda: store.put_bytes(f"r1/{name}/iter_000002.json", b"{}"),
                  lambda: store.put_if_absent(f"r1/{name}/x", b"{}"),
                  lambda: store.get_bytes(f"r1/{name}/iter_000001.json"),
                  lambda: store.list(f"r1/{name}/"),
                  lambda: store.delete(f"r1/{name}/iter_000001.json")):
        with pytest.raises(StoreError, match=rf"{root / 'r1' / name} is a link inside the storage root {root}"):
            write()
    if name == "metrics":
        with pytest.raises(StoreError, match="is a link inside the storage root"):
            RunStore(store, "r1").write_metrics(2, {"critic/score/mean": 0.5})
    assert sorted(os.listdir(outside)) == ["iter_000001.json"] and (outside / "iter_000001.json").read_text() == "theirs"


def test_a_linked_file_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    (root / "r1").mkdir(parents=True)
    (tmp_path / "secret").write_text("the user's")
    (root / "r1" / "run.json").symlink_to(tmp_path / "secret")
    store = ObjectStore(str(root))
    with pytest.raises(StoreError, match="is a link inside the storage root"):
        store.get_bytes("r1/run.json")
    with pytest.raises(StoreError, match="is a link inside the storage root"):
        store.put_bytes("r1/run.json", b"{}")
    assert (tmp_path / "secret").read_text() == "the user's"


def test_the_root_itself_may_be_a_link(tmp_path: Path) -> None:
    """The root is the user's own choice (./runs linked to a bigger disk): followed."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "disk")
    store = ObjectStore(str(tmp_path / "runs"))
    store.put_bytes("r1/metrics/iter_000001.json", b"{}")
    assert (tmp_path / "disk" / "r1" / "metrics" / "iter_000001.json").read_bytes() == b"{}"
