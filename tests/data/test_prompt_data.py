"""Prompt datasets: verl parquet / jsonl / json / `datasets` directories, validation, length filter."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.config import DataConfig
from engine.data.prompts import (
    PromptDataset,
    filter_long_prompts,
    load_prompts,
    load_train_val,
    write_rows_parquet,
)
from engine.data.sampler import PromptSampler
from engine.demo.data import ensure_synthetic_data
from engine.errors import DataError


def verl_row(i: int, content: str | None = None, source: str = "openai/gsm8k") -> dict[str, Any]:
    return {
        "data_source": source,
        "prompt": [
            {"role": "system", "content": "Answer after ####."},
            {"role": "user", "content": content if content is not None else f"question {i}?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"index": i, "split": "train"},
    }


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def message_length(messages: list[dict[str, Any]]) -> int:
    """A stand-in tokenizer: one token per character of the last message."""
    return len(messages[-1]["content"])


# ---------------------------------------------------------------------------------------- loading


def test_parquet_loads_as_typed_rows(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "train.parquet", [verl_row(i) for i in range(5)])
    ds = load_prompts([path])
    assert isinstance(ds, PromptDataset) and len(ds) == 5 and ds.sources == [str(path)]
    row = ds[3]
    assert row.prompt == verl_row(3)["prompt"]  # plain lists and dicts, not numpy arrays
    assert type(row.prompt) is list and type(row.prompt[0]) is dict
    assert (row.data_source, row.ground_truth, row.ability) == ("openai/gsm8k", "3", "math")
    assert row.extra_info == {"index": 3, "split": "train"}
    assert row.origin == f"{path}:3"
    assert row.to_record()["reward_model"]["ground_truth"] == "3"


def test_jsonl_loads_the_same_rows_as_parquet(tmp_path: Path) -> None:
    rows = [verl_row(i) for i in range(4)]
    from_parquet = load_prompts([write_parquet(tmp_path / "a.parquet", rows)])
    from_jsonl = load_prompts([write_jsonl(tmp_path / "a.jsonl", rows)])
    from_json = tmp_path / "a.json"
    from_json.write_text(json.dumps(rows))
    strip = lambda ds: [(r.prompt, r.data_source, r.ground_truth, r.extra_info, r.ability) for r in ds]  # noqa: E731
    assert strip(from_parquet) == strip(from_jsonl) == strip(load_prompts([from_json]))


def test_optional_keys_may_be_missing_and_messages_keep_only_set_fields(tmp_path: Path) -> None:
    rows = [
        {
            "data_source": "x",
            "prompt": [{"role": "user", "content": "hi"}],
            "reward_model": {"ground_truth": 7},
        }
    ]
    ds = load_prompts([write_jsonl(tmp_path / "min.jsonl", rows)])
    assert ds[0].extra_info == {} and ds[0].ability is None and ds[0].ground_truth == 7
    # A struct column gives every message every field seen in the file; unset ones are dropped.
    mixed = [verl_row(0), {**verl_row(1), "prompt": [{"role": "user", "content": "q", "name": "bob"}]}]
    ds = load_prompts([write_parquet(tmp_path / "mixed.parquet", mixed)])
    assert ds[0].prompt[0] == {"role": "system", "content": "Answer after ####."}
    assert ds[1].prompt == [{"role": "user", "content": "q", "name": "bob"}]


def test_several_files_concatenate_in_order(tmp_path: Path) -> None:
    a = write_parquet(tmp_path / "a.parquet", [verl_row(i) for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [verl_row(i) for i in range(10, 12)])
    ds = load_prompts([a, b], split="val")
    assert [r.ground_truth for r in ds] == ["0", "1", "2", "10", "11"]
    assert ds.sources == [str(a), str(b)] and ds.split == "val"
    assert ds[4].origin == f"{b}:1"
    assert [r.ground_truth for r in ds.take([4, 0])] == ["11", "0"]


def test_custom_prompt_key(tmp_path: Path) -> None:
    row = verl_row(0)
    row["messages"] = row.pop("prompt")
    ds = load_prompts([write_jsonl(tmp_path / "m.jsonl", [row])], prompt_key="messages")
    assert ds[0].prompt[-1]["content"] == "question 0?"
    with pytest.raises(DataError, match="key 'prompt': missing"):
        load_prompts([tmp_path / "m.jsonl"])


# ------------------------------------------------------------------------------------- validation


def _bad(row: dict[str, Any], **changes: Any) -> dict[str, Any]:
    row = json.loads(json.dumps(row))
    for key, value in changes.items():
        if value is _DELETE:
            row.pop(key)
        else:
            row[key] = value
    return row


_DELETE = object()


@pytest.mark.parametrize(
    ("changes", "key", "allowed"),
    [
        ({"prompt": _DELETE}, "prompt", "missing; expected a non-empty list of chat messages"),
        ({"prompt": "just text"}, "prompt", "expected a non-empty list of chat messages"),
        ({"prompt": []}, "prompt", "expected a non-empty list"),
        ({"prompt": [{"role": "user"}]}, "prompt", "message 0 is {'role': 'user'}"),
        ({"prompt": [{"role": "user", "content": 5}]}, "prompt", "'role': str, 'content': str"),
        ({"data_source": _DELETE}, "data_source", "expected a non-empty string"),
        ({"data_source": ""}, "data_source", "expected a non-empty string"),
        ({"reward_model": _DELETE}, "reward_model.ground_truth", "missing"),
        ({"reward_model": {"style": "rule"}}, "reward_model.ground_truth", "missing"),
        ({"reward_model": {"ground_truth": None}}, "reward_model.ground_truth", "missing"),
        ({"reward_model": {"ground_truth": True}}, "reward_model.ground_truth", "got bool True"),
        ({"reward_model": "42"}, "reward_model.ground_truth", "expected reward_model = {'ground_truth'"),
        ({"extra_info": [1, 2]}, "extra_info", "expected an object (dict) or nothing, got list"),
        ({"ability": 3}, "ability", "expected a string or nothing, got int"),
    ],
)
def test_a_malformed_row_names_file_row_and_key(
    tmp_path: Path, changes: dict[str, Any], key: str, allowed: str
) -> None:
    rows = [verl_row(0), _bad(verl_row(1), **changes), verl_row(2)]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_prompts([path])
    message = str(err.value)
    assert message.startswith(f"{path}: row 1: key {key!r}: "), message
    assert allowed in message
    assert "\n" not in message


def test_a_non_object_row_and_bad_json_name_the_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "list.jsonl", [verl_row(0), [1, 2]])
    with pytest.raises(DataError, match=r"list.jsonl: row 1: expected an object with keys 'prompt'"):
        load_prompts([path])
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(verl_row(0)) + "\n\n" + '{"prompt": [\n')
    with pytest.raises(DataError, match=r"broken.jsonl: row 1 \(line 3\): not valid JSON"):
        load_prompts([path])


def test_empty_missing_and_unknown_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"empty.jsonl: the file has no rows"):
        load_prompts([empty])
    schema = pa.schema([("prompt", pa.string())])
    pq.write_table(pa.Table.from_pylist([], schema=schema), tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"empty.parquet: the file has no rows"):
        load_prompts([tmp_path / "empty.parquet"])
    with pytest.raises(DataError, match=r"nope.parquet: no such file; expected .parquet, .jsonl"):
        load_prompts([tmp_path / "nope.parquet"])
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"rows.csv: unknown file kind; expected .parquet"):
        load_prompts([tmp_path / "rows.csv"])
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"junk.parquet: not a readable parquet file"):
        load_prompts([tmp_path / "junk.parquet"])
    with pytest.raises(DataError, match=r"no train files given"):
        load_prompts([])


def test_a_directory_without_the_datasets_package_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    (tmp_path / "saved").mkdir()
    with pytest.raises(DataError, match=r"saved: .*needs the 'datasets' package \(pip install datasets\)"):
        load_prompts([tmp_path / "saved"])


def test_a_datasets_directory_loads(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [verl_row(i) for i in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    ds = load_prompts([tmp_path / "one"])
    assert [r.ground_truth for r in ds] == ["0", "1", "2"] and ds[0].prompt == rows[0]["prompt"]
    both = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}
    )
    both.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"holds the splits train, test; name one as .*dict/train"):
        load_prompts([tmp_path / "dict"])
    assert len(load_prompts([tmp_path / "dict" / "train"])) == 3


# -------------------------------------------------------------------------------- length filtering


def test_long_prompts_are_dropped_with_a_count_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    contents = ["short", "x" * 30, "medium text", "y" * 50, "ok"]
    path = write_parquet(tmp_path / "t.parquet", [verl_row(i, c) for i, c in enumerate(contents)])
    with caplog.at_level(logging.WARNING, logger="rlflow.data"):
        ds = load_prompts([path], max_prompt_length=20, length_fn=message_length)
    assert [r.ground_truth for r in ds] == ["0", "2", "4"]
    assert "dropped 2 of 5 train prompts longer than max_prompt_length=20 tokens" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlflow.data"):
        load_prompts([path], max_prompt_length=50, length_fn=message_length)
    assert caplog.text == ""  # nothing dropped, nothing logged


def test_every_prompt_too_long_is_an_error(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "t.parquet", [verl_row(i, "z" * (10 + i)) for i in range(3)])
    ds = load_prompts([path])
    with pytest.raises(DataError) as err:
        filter_long_prompts(ds, 5, message_length)
    assert "every one of the 3 train prompts in" in str(err.value)
    assert "max_prompt_length=5 tokens (the shortest has 10)" in str(err.value)
    with pytest.raises(ValueError, match="needs a length_fn"):
        load_prompts([path], max_prompt_length=5)


def test_loaded_filtered_rows_feed_the_sampler(tmp_path: Path) -> None:
    contents = [f"q{i}" if i % 4 else "w" * 40 for i in range(20)]
    path = write_parquet(tmp_path / "t.parquet", [verl_row(i, c) for i, c in enumerate(contents)])
    ds = load_prompts([path], max_prompt_length=10, length_fn=message_length)
    assert len(ds) == 15
    sampler = PromptSampler(len(ds), batch_size=4, seed=3)
    seen = [ds.take(sampler.next_indices()) for _ in range(sampler.steps_per_epoch)]
    truths = [row.ground_truth for step in seen for row in step]
    assert all(len(step) == 4 for step in seen) and len(set(truths)) == 12
    assert not {"0", "4", "8", "12", "16"} & set(truths)


# ---------------------------------------------------------------------------------- synthetic data


def test_ensure_synthetic_data_writes_once_then_reuses(tmp_path: Path) -> None:
    train, val = ensure_synthetic_data("arith", tmp_path / "cache", train_size=30, val_size=6, seed=1)
    assert train.exists() and val.exists()
    stamp = (train.stat().st_mtime_ns, val.stat().st_mtime_ns)
    again = ensure_synthetic_data("arith", tmp_path / "cache", train_size=30, val_size=6, seed=1)
    assert again == (train, val) and (train.stat().st_mtime_ns, val.stat().st_mtime_ns) == stamp
    other, _ = ensure_synthetic_data("arith", tmp_path / "cache", train_size=31, val_size=6, seed=1)
    assert other != train  # other settings never reuse stale files
    assert not [p for p in os.listdir(tmp_path / "cache") if p.endswith(".tmp")]
    assert len(load_prompts([train])) == 30 and load_prompts([val])[0].extra_info["split"] == "val"
    with pytest.raises(DataError, match=r"unknown synthetic task 'nope'; allowed: arith, sort"):
        ensure_synthetic_data("nope", tmp_path, 3, 3, 0)


def test_write_rows_parquet_leaves_no_partial_file(tmp_path: Path) -> None:
    with pytest.raises((pa.ArrowException, TypeError)):
        write_rows_parquet([{"a": object()}], tmp_path / "x.parquet")
    assert os.listdir(tmp_path) == []


def test_load_train_val_from_config(tmp_path: Path) -> None:
    cfg = DataConfig(task="sort", train_size=40, val_size=8, max_prompt_length=12)
    with pytest.raises(DataError, match="data.train_files is empty"):
        load_train_val(cfg, length_fn=message_length)
    synthetic = ensure_synthetic_data("sort", tmp_path, train_size=40, val_size=8, seed=0)
    train, val = load_train_val(cfg, length_fn=message_length, synthetic_files=synthetic)
    assert val is not None and len(val) <= 8 and 0 < len(train) <= 40
    assert all(len(r.prompt[-1]["content"]) <= 12 for r in train)
    [written] = tmp_path.glob("sort_train_n40_seed0_*.parquet")  # the name ends with the generator's digest
    files = DataConfig(train_files=[str(written)])
    train, val = load_train_val(files, length_fn=message_length)
    assert val is None and len(train) == 40


def test_truncation_error_names_the_first_long_row(tmp_path: Path) -> None:
    contents = ["short", "x" * 30, "medium text"]
    path = write_parquet(tmp_path / "t.parquet", [verl_row(i, c) for i, c in enumerate(contents)])
    with pytest.raises(DataError) as err:
        load_prompts([path], max_prompt_length=20, length_fn=message_length, truncation="error")
    assert str(err.value).startswith(f"train row {path}:1 has ") and "data.truncation=error" in str(err.value)
    assert len(load_prompts([path], max_prompt_length=20, length_fn=message_length, truncation="left")) == 3


def test_truncation_left_and_right_cut_the_encoded_prompt(tmp_path: Path) -> None:
    """left keeps the last tokens (the end of the conversation and the generation prompt), right the first."""
    from engine.demo.tiny import build_tokenizer
    from engine.models.loading import load_tokenizer
    from engine.models.tokens import encode_prompts

    tok = build_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    prompts = [[{"role": "user", "content": "1234567890"}], [{"role": "user", "content": "12"}]]
    full = encode_prompts(tok, prompts)
    row0 = full.input_ids[0][full.attention_mask[0].bool()].tolist()
    left, right = encode_prompts(tok, prompts, 6, "left"), encode_prompts(tok, prompts, 6, "right")
    assert left.input_ids.shape[1] == right.input_ids.shape[1] == 6
    assert left.input_ids[0].tolist() == row0[-6:] and right.input_ids[0].tolist() == row0[:6]
    short = full.input_ids[1][full.attention_mask[1].bool()].tolist()
    assert left.input_ids[1][left.attention_mask[1].bool()].tolist() == short  # short prompts untouched


def test_sources_are_absolute_so_a_stage_in_another_folder_reads_them(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """data.train_files=data/train.parquet, relative to where `rlflow train` runs: the dataset names the file
    as the stage workers (Ray processes with a working folder of their own) must open it (conversations:
    tests/data/test_conversations.py)."""
    (tmp_path / "data").mkdir()
    write_parquet(tmp_path / "data" / "train.parquet", [verl_row(i) for i in range(3)])
    monkeypatch.chdir(tmp_path)
    prompts = load_prompts(["data/train.parquet"])
    monkeypatch.chdir("/")
    assert prompts.sources == [str(tmp_path / "data" / "train.parquet")]
    assert len(load_prompts(prompts.sources).rows) == 3
