"""engine/_dists.py: the kept packages_distributions() equals the real one, and an install is seen at once."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

from engine import _dists


def _distribution(folder: Path, name: str, top: str) -> None:
    info = folder / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{top}\n")
    (info / "RECORD").write_text(f"{top}/__init__.py,,\n{info.name}/METADATA,,\n")


def test_the_kept_mapping_equals_the_real_one_and_follows_installs(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert importlib.metadata.packages_distributions is _dists.packages_distributions  # engine/__init__.py
    prefix, site = tmp_path / "prefix", tmp_path / "site"
    prefix.mkdir()
    site.mkdir()
    monkeypatch.setattr(sys, "prefix", str(prefix))
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    real = {k: sorted(v) for k, v in _dists._original().items()}

    first = _dists.packages_distributions()
    assert {k: sorted(v) for k, v in first.items()} == real
    kept = json.loads((prefix / _dists.FILE).read_text())
    assert list(kept) == [_dists._key()]
    calls = []
    monkeypatch.setattr(_dists, "_original", lambda: calls.append(1) or {})
    assert _dists.packages_distributions() == first and not calls  # read from the file, not computed

    monkeypatch.undo()
    monkeypatch.setattr(sys, "prefix", str(prefix))
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    _distribution(site, "rlflow_probe_dist", "rlflow_probe")  # an install: the key changes
    after = _dists.packages_distributions()
    assert after["rlflow_probe"] == ["rlflow_probe_dist"] and "rlflow_probe" not in first
    assert {k: sorted(v) for k, v in after.items()} == {k: sorted(v) for k, v in _dists._original().items()}
    assert len(json.loads((prefix / _dists.FILE).read_text())) == 2


def test_a_bad_file_is_ignored_and_an_unwritable_prefix_computes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    real = {"torch": ["torch"]}
    monkeypatch.setattr(_dists, "_original", lambda: real)  # what is computed when nothing usable is kept
    (tmp_path / _dists.FILE).write_text(json.dumps({_dists._key(): {"torch": "not a list"}}))
    assert _dists.packages_distributions() == real
    (tmp_path / _dists.FILE).write_text("not json")
    assert _dists.packages_distributions() == real
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "missing"))
    assert _dists.packages_distributions() == real and not (tmp_path / "missing").exists()
