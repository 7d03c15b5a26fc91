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


def ensure_demonstrations(
    task: str, out_dir: str | os.PathLike[str], train_size: int, val_size: int, seed: int, kind: str = "sft"
) -> tuple[Path, Path]:
    """algorithm.objective=sft or dpo without data.train_files: the synthetic task's rows as SFT
    conversations (kind "sft": the prompt, then the task's reference answer as the assistant's turn) or as
    preference pairs ("dpo": the reference answer chosen, a wrong one rejected: sort and arith only),
    written on first use as `ensure_synthetic_data`'s files are, with the same rows."""
    import pyarrow.parquet as pq

    from engine.data.conversations import demonstrations
    from engine.data.preferences import preference_pairs

    if kind == "dpo" and task not in ("sort", "arith"):
        raise DataError(f"data.task={task!r} has no synthetic preference pairs (sort and arith have); give "
                        "data.train_files with prompt, chosen and rejected columns")
    prompts = ensure_synthetic_data(task, out_dir, train_size, val_size, seed)
    out = []
    for path in prompts:
        target = path.with_name(path.name.replace(f"{task}_", f"{task}_{kind}_", 1))
        if not target.exists():
            rows = pq.read_table(path).to_pylist()
            made = (demonstrations(rows, synthetic.solution_text) if kind == "sft" else
                    preference_pairs(rows, synthetic.solution_text, synthetic.wrong_solution))
            write_rows_parquet(made, target)
        out.append(target)
    return out[0], out[1]
