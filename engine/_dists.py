"""`importlib.metadata.packages_distributions()`, computed once per set of installed distributions.

transformers calls it when imported (transformers/utils/import_utils.py), and it reads the RECORD of
every installed distribution: in the test line's venv (vLLM's dependencies included, ~300 top-level
names from ~30,000 files) about 0.85 CPU s in every process that imports transformers, which is every
stage worker, rank and CLI process. The result depends only on what is installed, so it is kept in the
environment's own folder (`sys.prefix`, a venv's), under a key made of the names of the `*.dist-info` /
`*.egg-info` folders on `sys.path` (they carry each distribution's version) and the Python version; the
key is checked on every call (one directory listing per `sys.path` entry), so an install or uninstall is
seen at once. Where `sys.prefix` is not writable nothing is kept and each call computes it as before.

The kept file is JSON, never code, and is only used when it parses to the expected shape.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

FILE = "rlflow-packages-distributions.json"
KEEP = 16  # keys kept: processes whose sys.path differs (Ray workers add their own entries) each have one
_original: Callable[[], Mapping[str, list[str]]] = importlib.metadata.packages_distributions


def _key() -> str:
    names = [sys.version]
    for entry in sys.path:
        try:
            listed = os.listdir(entry or ".")
        except OSError:
            continue
        names.append(entry)
        names.extend(sorted(n for n in listed if n.endswith((".dist-info", ".egg-info"))))
    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def _valid(entry: Any) -> bool:
    return isinstance(entry, dict) and all(
        isinstance(k, str) and isinstance(v, list) and all(isinstance(d, str) for d in v) for k, v in entry.items())


def packages_distributions() -> Mapping[str, list[str]]:
    """What `importlib.metadata.packages_distributions()` returns, from the kept file when it has the key."""
    path = os.path.join(sys.prefix, FILE)
    key = _key()
    kept: dict[str, Any] = {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        kept = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        pass
    if _valid(kept.get(key)):
        return {k: list(v) for k, v in kept[key].items()}
    found = _original()
    kept = {k: v for k, v in list(kept.items())[-(KEEP - 1):] if k != key}
    kept[key] = {k: list(v) for k, v in found.items()}
    try:
        fd, tmp = tempfile.mkstemp(dir=sys.prefix, prefix=".rlflow-dists-")
    except OSError:
        return found
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(kept, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # atomic; a concurrent writer's key may be dropped and is computed again
    except OSError:
        os.unlink(tmp)
    return found


def install() -> None:
    """Before transformers is imported (engine/__init__.py)."""
    importlib.metadata.packages_distributions = packages_distributions
