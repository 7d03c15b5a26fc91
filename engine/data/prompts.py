"""Prompt datasets in verl's layout: parquet, jsonl, or a Hugging Face `datasets` directory.

One row (verl `examples/data_preprocess/gsm8k.py` writes the same columns):

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "math",                                   # optional
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"index": 0, "split": "train"}}        # optional

Every row is checked when loaded; the first bad one raises a `DataError` naming the file, the row index
and the key. Prompts longer than `data.max_prompt_length` tokens are dropped with a count in the log,
as verl's `filter_overlong_prompts` does; the tokenizer lives elsewhere, so the caller passes `length_fn`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine.config import DataConfig
from engine.errors import DataError

log = logging.getLogger("rlflow.data")

Message = dict[str, Any]  # {"role": str, "content": str, ...}
LengthFn = Callable[[list[Message]], int]  # chat messages -> prompt length in tokens

FILE_KINDS = ".parquet, .jsonl, .json (a list of rows), or a directory written by datasets' save_to_disk"


@dataclass(frozen=True)
class PromptRow:
    """One validated prompt. `origin` ("file:row") points back at the input for later messages."""

    prompt: list[Message]
    data_source: str
    ground_truth: Any  # str in most datasets; a number, list or dict where a reward expects one
    extra_info: dict[str, Any] = field(default_factory=dict)
    ability: str | None = None
    origin: str = ""

    def to_record(self) -> dict[str, Any]:
        """The row in verl's layout again (what the synthetic writer and buffers store)."""
        return {
            "data_source": self.data_source,
            "prompt": self.prompt,
            "ability": self.ability,
            "reward_model": {"style": "rule", "ground_truth": self.ground_truth},
            "extra_info": self.extra_info,
        }


@dataclass(frozen=True)
class PromptDataset:
    """Validated rows of one split, concatenated from `sources` in order."""

    rows: list[PromptRow]
    sources: list[str]
    split: str = "train"

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]

    def __iter__(self) -> Iterator[PromptRow]:
        return iter(self.rows)

    def take(self, indices: Sequence[int]) -> list[PromptRow]:
        """The rows of one sampler step."""
        return [self.rows[i] for i in indices]


# --------------------------------------------------------------------------------------- loading


def load_prompts(
    files: Sequence[str | os.PathLike[str]],
    *,
    split: str = "train",
    prompt_key: str = "prompt",
    max_prompt_length: int | None = None,
    length_fn: LengthFn | None = None,
    truncation: str = "drop",
) -> PromptDataset:
    """Load, validate and concatenate `files`; with `max_prompt_length`, drop the prompts over it
    (truncation "drop") or refuse them ("error"); "left" and "right" keep every prompt, which the
    encoding cuts (engine.models.tokens.encode_prompts).

    `length_fn` counts the tokens of a prompt's chat messages (the tokenizer's chat template applied);
    it is required when `max_prompt_length` is set.
    """
    if not files:
        raise DataError(f"no {split} files given; expected one or more {FILE_KINDS}")
    rows: list[PromptRow] = []
    for path in files:
        rows.extend(_load_file(str(path), prompt_key))
    dataset = PromptDataset(rows, [absolute_source(p) for p in files], split)
    if max_prompt_length is not None and truncation in ("drop", "error"):
        if length_fn is None:
            raise ValueError("max_prompt_length needs a length_fn (prompt messages -> tokens)")
        if truncation == "error":
            refuse_long_prompts(dataset, max_prompt_length, length_fn)
        else:
            dataset = filter_long_prompts(dataset, max_prompt_length, length_fn)
    return dataset


def refuse_long_prompts(dataset: PromptDataset, max_length: int, length_fn: LengthFn) -> None:
    """data.truncation=error: the first prompt over `max_length` tokens is one DataError naming it."""
    for row in dataset.rows:
        n = length_fn(row.prompt)
        if n > max_length:
            raise DataError(f"{dataset.split} row {row.origin} has {n} prompt tokens, over data.max_prompt_length="
                            f"{max_length} (data.truncation=error); raise the limit, or set data.truncation to "
                            "drop, left or right")


def load_train_val(
    cfg: DataConfig, *, length_fn: LengthFn, synthetic_files: tuple[Path, Path] | None = None
) -> tuple[PromptDataset, PromptDataset | None]:
    """The train and validation sets of a run: `cfg.train_files`, or, without them, `synthetic_files` (the
    synthetic `cfg.task`'s train and validation files, which the flows layer writes: engine.demo.data).

    Validation is None when train files are given without validation files (no validation then).
    """
    train_files: list[str] = list(cfg.train_files)
    val_files: list[str] = list(cfg.val_files)
    if not train_files:
        if synthetic_files is None:
            raise DataError(f"data.train_files is empty and the files of the synthetic data.task={cfg.task!r} were "
                            "not given (the flows layer writes them: engine.demo.data.ensure_synthetic_data)")
        train_path, val_path = synthetic_files
        train_files, val_files = [str(train_path)], val_files or [str(val_path)]

    def load(files: list[str], split: str) -> PromptDataset:
        return load_prompts(
            files,
            split=split,
            prompt_key=cfg.prompt_key,
            max_prompt_length=cfg.max_prompt_length,
            length_fn=length_fn,
            truncation=cfg.truncation,
        )

    return load(train_files, "train"), (load(val_files, "val") if val_files else None)


def filter_long_prompts(dataset: PromptDataset, max_length: int, length_fn: LengthFn) -> PromptDataset:
    """Drop rows whose prompt is longer than `max_length` tokens, logging how many went."""
    lengths = [length_fn(row.prompt) for row in dataset.rows]
    kept = [row for row, n in zip(dataset.rows, lengths) if n <= max_length]
    dropped = len(dataset.rows) - len(kept)
    if not kept:
        raise DataError(
            f"every one of the {len(lengths)} {dataset.split} prompts in {', '.join(dataset.sources)} is "
            f"longer than data.max_prompt_length={max_length} tokens (the shortest has {min(lengths)}); "
            "raise data.max_prompt_length or use shorter prompts"
        )
    if dropped:
        log.warning(
            "dropped %d of %d %s prompts longer than max_prompt_length=%d tokens (longest: %d)",
            dropped,
            len(lengths),
            dataset.split,
            max_length,
            max(lengths),
        )
    return PromptDataset(kept, dataset.sources, dataset.split)


def absolute_source(path: str | os.PathLike[str]) -> str:
    """A data file as the run's stage workers must name it: `~` expanded and a relative path made absolute
    from this process's working folder (a stage runs in a Ray worker with a folder of its own)."""
    return os.path.abspath(os.path.expanduser(str(path)))


def _load_file(path: str, prompt_key: str) -> list[PromptRow]:
    records = _read_records(path)
    if not records:
        raise DataError(f"{path}: the file has no rows; a dataset needs at least one prompt")
    return [_validate_row(record, path, i, prompt_key) for i, record in enumerate(records)]


def _read_records(path: str) -> list[dict[str, Any]]:
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        return _read_hf_dataset_dir(path)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file; expected {FILE_KINDS}")
    if path.endswith(".parquet"):
        return _read_parquet(path)
    if path.endswith(".jsonl"):
        return _read_jsonl(path)
    if path.endswith(".json"):
        return _read_json_list(path)
    raise DataError(f"{path}: unknown file kind; expected {FILE_KINDS}")


def _read_parquet(path: str) -> list[dict[str, Any]]:
    try:
        # to_pylist gives plain Python lists and dicts for list<struct> and struct columns
        # (pandas would give numpy object arrays instead).
        records: list[dict[str, Any]] = pq.read_table(path).to_pylist()
        return records
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file ({err})") from err


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}: row {len(records)} (line {line_no}): not valid JSON ({err.msg}); "
                    "expected one JSON object per line"
                ) from err
            records.append(record)
    return records


def _read_json_list(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err}); expected a list of rows") from err
    if not isinstance(records, list):
        raise DataError(f"{path}: expected a JSON list of rows, got {type(records).__name__}")
    return list(records)


def _read_hf_dataset_dir(path: str) -> list[dict[str, Any]]:
    # Imported here: `datasets` is an optional dependency, needed only for this input kind.
    try:
        import datasets  # type: ignore[import-not-found, unused-ignore]
    except ImportError as err:
        raise DataError(
            f"{path}: a directory is read as a Hugging Face dataset saved with save_to_disk, which needs "
            "the 'datasets' package (pip install datasets); or convert it to parquet"
        ) from err
    try:
        loaded = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as err:
        raise DataError(f"{path}: not a dataset written by save_to_disk ({err})") from err
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if len(splits) != 1:
            raise DataError(
                f"{path}: holds the splits {', '.join(splits)}; name one as {os.path.join(path, splits[0])}"
            )
        loaded = loaded[splits[0]]
    return list(loaded.to_list())


# ------------------------------------------------------------------------------------ validation


def _validate_row(record: Any, path: str, index: int, prompt_key: str) -> PromptRow:
    def fail(key: str, problem: str) -> DataError:
        return DataError(f"{path}: row {index}: key {key!r}: {problem}")

    if not isinstance(record, dict):
        raise DataError(
            f"{path}: row {index}: expected an object with keys {prompt_key!r}, "
            f"'data_source', 'reward_model', got {type(record).__name__}"
        )
    prompt = _validate_prompt(record.get(prompt_key), lambda problem: fail(prompt_key, problem))

    data_source = record.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise fail("data_source", f"expected a non-empty string naming the dataset, got {data_source!r}")

    reward_model = record.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise fail("reward_model.ground_truth", "missing; expected reward_model = {'ground_truth': ...}")
    truth = reward_model["ground_truth"]
    if not _is_ground_truth(truth):
        raise fail(
            "reward_model.ground_truth",
            f"expected a string, a finite number, a list or a dict, got {type(truth).__name__} {truth!r}",
        )

    extra_info = record.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise fail("extra_info", f"expected an object (dict) or nothing, got {type(extra_info).__name__}")

    ability = record.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise fail("ability", f"expected a string or nothing, got {type(ability).__name__}")

    return PromptRow(prompt, data_source, truth, extra_info, ability, origin=f"{path}:{index}")


def _validate_prompt(prompt: Any, fail: Callable[[str], DataError]) -> list[Message]:
    expected = "a non-empty list of chat messages {'role': str, 'content': str}"
    if prompt is None:
        raise fail(f"missing; expected {expected}")
    # pyarrow and `datasets` give lists; a tuple from other writers is fine too.
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise fail(f"expected {expected}, got {type(prompt).__name__} {_short(prompt)}")
    messages: list[Message] = []
    for j, message in enumerate(prompt):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise fail(f"message {j} is {_short(message)}; expected {expected}")
        # Struct columns give every message every field seen in the file; drop the unset ones.
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


def _is_ground_truth(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, (str, int, list, dict))


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------ writing rows


def write_rows_parquet(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write verl-layout rows to `path` atomically: a temp file in the same folder, then a rename.

    A reader (or a second writer racing this one) never sees a half-written file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
