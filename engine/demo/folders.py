"""Where a demo build writes: a new or empty folder that ends up holding the whole build or nothing."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.errors import RLFlowError


def empty_target(out_dir: str | Path) -> Path:
    """`out_dir` as a Path, refused unless it is absent or an empty folder; its parent is made."""
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RLFlowError(f"{out} already exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


@contextmanager
def into_place(out: Path) -> Iterator[Path]:
    """A temporary sibling of `out` to build into, renamed to `out` when the block ends (atomic: it replaces
    an empty folder and fails on a full one) and removed if the block raises."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        readable(tmp)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def readable(directory: Path) -> None:
    """mkdtemp makes the folder private (0700); a shared model cache should not be."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)
