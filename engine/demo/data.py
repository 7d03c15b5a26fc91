"""The synthetic tasks' parquet files: what `rlflow data make` writes, and a run's train and validation
files when data.train_files is empty (written on first use by the flows layer, then reused)."""

from __future__ import annotations

import os
from pathlib import Path

from engine.data.prompts import write_rows_parquet
from engine.demo import synthetic
from engine.errors import DataError


def make_synthetic_files(
    task: str,
    out_dir: str | os.PathLike[str],
    *,
    n: int,
    val_n: int,
    seed: int,
    train_name: str = "train.parquet",
    val_name: str = "val.parquet",
) -> tuple[Path, Path]:
    """Write `n` train and `val_n` validation rows of a synthetic task (what `rlflow data make` does)."""
    if task not in synthetic.TASKS:
        raise DataError(f"unknown synthetic task {task!r}; allowed: {', '.join(synthetic.TASKS)}")
    if n <= 0 or val_n <= 0:
        raise DataError(f"row counts must be positive, got n={n}, val_n={val_n}")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file where a folder must be, no permission
        raise DataError(f"cannot make the output folder {str(out)!r}: {err.strerror}") from None
    train = write_rows_parquet(synthetic.make_rows(task, n, seed, "train"), out / train_name)
    val = write_rows_parquet(synthetic.make_rows(task, val_n, seed, "val"), out / val_name)
    return train, val


def ensure_synthetic_data(
    task: str, out_dir: str | os.PathLike[str], train_size: int, val_size: int, seed: int
) -> tuple[Path, Path]:
    """The train and validation parquet files of a synthetic task, written on first use, then reused.

    The file names carry (task, size, seed) and the generator's source (engine.models.loading.source_digest), so
    a run with other settings, or after an edit to the generator, never reuses stale files.
    """
    from engine.models.loading import source_digest

    out = Path(out_dir)
    digest = source_digest(Path(synthetic.__file__))
    train = out / f"{task}_train_n{train_size}_seed{seed}_{digest}.parquet"
    val = out / f"{task}_val_n{val_size}_seed{seed}_{digest}.parquet"
    if train.exists() and val.exists():
        return train, val
    return make_synthetic_files(
        task, out, n=train_size, val_n=val_size, seed=seed, train_name=train.name, val_name=val.name
    )
