"""Tests for engine/batch.py: construction, row ops, sharding, equality, hashing, parquet."""

from __future__ import annotations

import ast
import io
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.batch import Batch

FAST = settings(max_examples=40, deadline=None)


def make_batch(size: int = 6, seq: int = 4) -> Batch:
    """A Batch with a mix of tensors, columns and meta; row b is identifiable by `row`."""
    gen = torch.Generator().manual_seed(size * 100 + seq)
    return Batch(
        tensors={
            "row": torch.arange(size),
            "input_ids": torch.randint(0, 100, (size, seq), generator=gen),
            "logp": torch.randn(size, seq, generator=gen).bfloat16(),
            "mask": torch.rand(size, seq, generator=gen) > 0.3,
        },
        columns={
            "prompt": [f"prompt {b}" for b in range(size)],
            "info": [{"b": b, "tags": ["x"] * (b % 3)} for b in range(size)],
        },
        meta={"iteration": 3, "kl_coef": 0.05},
    )


def roundtrip(batch: Batch) -> Batch:
    return Batch.from_parquet_bytes(batch.to_parquet_bytes())


def read_pandas(data: bytes) -> pd.DataFrame:
    # use_threads=False: see Batch.from_parquet (apache/arrow#34314, abort at exit with torch).
    return pd.read_parquet(io.BytesIO(data), use_threads=False)


# ------------------------------------------------------------------ construction


def test_length_mismatch_names_key_and_lengths() -> None:
    with pytest.raises(ValueError, match=r"'logp' has length 3 but B=4"):
        Batch({"ids": torch.zeros(4, 2), "logp": torch.zeros(3)}, {})
    with pytest.raises(ValueError, match=r"column 'text' has length 5 but B=4"):
        Batch({"ids": torch.zeros(4, 2)}, {"text": ["a"] * 5})


def test_key_unique_across_tensors_and_columns() -> None:
    with pytest.raises(ValueError, match="'x'"):
        Batch({"x": torch.zeros(2)}, {"x": [1, 2]})


def test_construction_type_errors() -> None:
    with pytest.raises(TypeError, match="'c' is a tuple, not a list"):
        Batch({}, {"c": (1, 2)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="'t' is a list, not a torch.Tensor"):
        Batch({"t": [1, 2]}, {})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="0-d"):
        Batch({"t": torch.tensor(1.0)}, {})


def test_access() -> None:
    batch = make_batch(5)
    assert len(batch) == 5
    assert batch.tensor_keys == ["row", "input_ids", "logp", "mask"]
    assert batch.column_keys == ["prompt", "info"]
    assert batch.keys() == batch.tensor_keys + batch.column_keys
    assert "logp" in batch and "prompt" in batch and "nope" not in batch
    assert batch["prompt"][2] == "prompt 2"
    assert batch.tensors["input_ids"].shape == (5, 4)
    with pytest.raises(KeyError, match="available"):
        batch["nope"]
    assert len(Batch({}, {})) == 0
    assert "B=5" in repr(batch) and "bfloat16[B, 4]" in repr(batch)


# ---------------------------------------------------------- select / with_*


def test_select() -> None:
    batch = make_batch()
    sub = batch.select("logp", "prompt")
    assert sub.keys() == ["logp", "prompt"]
    assert sub.meta == batch.meta
    assert sub["logp"] is batch["logp"]  # shared, not copied


def test_select_errors_name_missing_and_available() -> None:
    batch = make_batch()
    with pytest.raises(KeyError, match=r"\['nope', 'gone'\].*available.*'input_ids'"):
        batch.select("logp", "nope", "gone")
    with pytest.raises(ValueError, match="at least one key"):
        batch.select()


def test_with_tensors_and_columns_return_new_batches() -> None:
    batch = make_batch(4)
    added = batch.with_tensors(adv=torch.ones(4, 4), logp=torch.zeros(4, 4))
    assert added.tensors["adv"].shape == (4, 4) and added.tensors["logp"].dtype == torch.float32
    assert "adv" not in batch and batch.tensors["logp"].dtype == torch.bfloat16
    more = batch.with_columns(reward=[1.0, 0.0, 0.5, 1.0])
    assert more["reward"] == [1.0, 0.0, 0.5, 1.0] and "reward" not in batch
    with pytest.raises(ValueError, match="'adv' has length 3 but B=4"):
        batch.with_tensors(adv=torch.ones(3))
    with pytest.raises(ValueError, match="'reward' has length 2 but B=4"):
        batch.with_columns(reward=[1.0, 2.0])
    with pytest.raises(ValueError, match="'prompt'"):
        batch.with_tensors(prompt=torch.ones(4))
    meta = batch.with_meta(iteration=4)
    assert meta.meta == {"iteration": 4, "kl_coef": 0.05} and batch.meta["iteration"] == 3


# ----------------------------------------------------------------- row ops


def test_index_forms_agree() -> None:
    batch = make_batch(6)
    expected = [4, 0, 0, 5]
    for idx in ([4, 0, 0, -1], torch.tensor([4, 0, 0, 5]), torch.tensor([4, 0, 0, -1], dtype=torch.int32)):
        picked = batch.index(idx)
        assert picked.tensors["row"].tolist() == expected
        assert picked["prompt"] == [f"prompt {i}" for i in expected]
        assert torch.equal(picked.tensors["input_ids"], batch.tensors["input_ids"][expected])
    assert batch.index(slice(1, 5, 2)).tensors["row"].tolist() == [1, 3]
    assert batch.index(slice(None, None, -2))["prompt"] == ["prompt 5", "prompt 3", "prompt 1"]
    mask = torch.tensor([True, False, True, False, False, True])
    assert batch.index(mask).tensors["row"].tolist() == [0, 2, 5]
    assert len(batch.index([])) == 0


def test_index_errors() -> None:
    batch = make_batch(3)
    with pytest.raises(IndexError, match="row index 3 out of range for B=3"):
        batch.index([0, 3])
    with pytest.raises(IndexError, match="-4"):
        batch.index([-4])
    with pytest.raises(TypeError, match="one row"):
        batch.index(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        batch.index([0.5])  # type: ignore[list-item]
    with pytest.raises(IndexError, match="mask"):
        batch.index(torch.tensor([True, False]))


def test_repeat_interleave_groups_are_consecutive() -> None:
    batch = make_batch(3)
    grouped = batch.repeat_interleave(2)
    assert grouped.tensors["row"].tolist() == [0, 0, 1, 1, 2, 2]
    assert grouped["prompt"] == ["prompt 0", "prompt 0", "prompt 1", "prompt 1", "prompt 2", "prompt 2"]
    assert torch.equal(
        grouped.tensors["input_ids"].view(3, 2, 4)[:, 1], batch.tensors["input_ids"]
    )  # [B, G, T]
    assert grouped.meta == batch.meta
    assert Batch.equal(batch.repeat_interleave(1), batch)
    with pytest.raises(ValueError, match="n >= 1"):
        batch.repeat_interleave(0)


def test_chunks_sizes() -> None:
    batch = make_batch(10)
    chunks = batch.chunks(4)
    assert [len(c) for c in chunks] == [4, 4, 2]
    assert Batch.equal(Batch.concat(chunks), batch)
    assert [len(c) for c in batch.chunks(10)] == [10]
    assert [len(c) for c in batch.chunks(20)] == [10]
    assert batch.index([]).chunks(3) == []
    for bad in (0, -1):
        with pytest.raises(ValueError, match="> 0"):
            batch.chunks(bad)


def test_shuffle_keeps_rows_together_and_is_seeded() -> None:
    batch = make_batch(8)
    shuffled = batch.shuffle(torch.Generator().manual_seed(0))
    order = shuffled.tensors["row"].tolist()
    assert sorted(order) == list(range(8)) and order != list(range(8))
    assert shuffled["prompt"] == [f"prompt {i}" for i in order]
    assert torch.equal(shuffled.tensors["logp"], batch.tensors["logp"][order])
    again = batch.shuffle(torch.Generator().manual_seed(0))
    assert Batch.equal(again, shuffled)


def test_to_device() -> None:
    batch = make_batch(3)
    moved = batch.to("meta")
    assert all(t.device.type == "meta" for t in moved.tensors.values())
    assert moved["prompt"] == batch["prompt"] and moved.meta == batch.meta
    assert Batch.equal(batch.to("cpu"), batch)


# ------------------------------------------------------------ split / concat


def test_split_pads_by_wrapping_from_the_start() -> None:
    batch = make_batch(5)
    shards, pad = batch.split(4)
    assert pad == 3
    assert [s.tensors["row"].tolist() for s in shards] == [[0, 1], [2, 3], [4, 0], [1, 2]]
    shards, pad = batch.index([0]).split(4)  # pad larger than B wraps repeatedly
    assert pad == 3 and [s.tensors["row"].tolist() for s in shards] == [[0]] * 4
    with pytest.raises(ValueError, match="n >= 1"):
        batch.split(0)


@FAST
@given(size=st.integers(0, 20), n=st.integers(1, 8))
def test_split_concat_unpad_are_inverses(size: int, n: int) -> None:
    batch = make_batch(size)
    shards, pad = batch.split(n)
    assert len(shards) == n
    assert len({len(s) for s in shards}) == 1
    assert pad == (-size % n if size else 0)
    assert sum(len(s) for s in shards) == size + pad
    assert Batch.equal(Batch.unpad(Batch.concat(shards), pad), batch)


def test_unpad_bounds() -> None:
    batch = make_batch(3)
    assert len(Batch.unpad(batch, 3)) == 0
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        Batch.unpad(batch, 4)


def test_concat_errors_name_the_mismatch() -> None:
    batch = make_batch(3)
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])
    with pytest.raises(ValueError, match=r"batch 1 .*missing tensors \['mask'\]"):
        Batch.concat([batch, batch.select("row", "input_ids", "logp", "prompt", "info")])
    with pytest.raises(ValueError, match=r"extra columns \['reward'\]"):
        Batch.concat([batch, batch.with_columns(reward=[0, 1, 2])])
    with pytest.raises(ValueError, match=r"'logp' is float32\[B, 4\] but bfloat16\[B, 4\]"):
        Batch.concat([batch, batch.with_tensors(logp=batch.tensors["logp"].float())])
    with pytest.raises(ValueError, match=r"'logp' is bfloat16\[B, 2, 2\]"):
        Batch.concat([batch, batch.with_tensors(logp=batch.tensors["logp"].view(3, 2, 2))])


def test_concat_takes_meta_from_first() -> None:
    batch = make_batch(2)
    joined = Batch.concat([batch, batch.with_meta(iteration=9)])
    assert joined.meta["iteration"] == 3 and len(joined) == 4


# ---------------------------------------------------------------- equality


def test_equal_is_exact() -> None:
    batch = make_batch(3)
    assert Batch.equal(batch, roundtrip(batch)) and batch == roundtrip(batch)
    assert not Batch.equal(batch, batch.with_tensors(logp=batch.tensors["logp"].float()))
    assert not Batch.equal(batch, batch.with_tensors(row=torch.tensor([0, 1, 7])))
    assert not Batch.equal(batch, batch.with_columns(prompt=["a", "b", "c"]))
    assert not Batch.equal(batch, batch.with_meta(iteration=4))
    assert not Batch.equal(batch, batch.select("row"))
    nan = Batch({"x": torch.tensor([math.nan, 0.0])}, {})
    assert Batch.equal(nan, roundtrip(nan))  # same bits, although nan != nan
    assert not Batch.equal(nan, Batch({"x": torch.tensor([math.nan, -0.0])}, {}))
    assert not Batch.equal(Batch({}, {"c": [1]}), Batch({}, {"c": [1.0]}))
    assert not Batch.equal(Batch({}, {"c": [1]}), Batch({}, {"c": [True]}))


# ------------------------------------------------------------------ parquet

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int32, torch.int8, torch.bool, torch.uint8]  # fmt: skip
SHAPES = [(5,), (5, 3), (5, 3, 2), (5, 1, 4, 1)]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen).to(dtype)
        flat = t.view(-1)
        flat[: min(3, flat.numel())] = torch.tensor([math.nan, -0.0, math.inf])[: min(3, flat.numel())].to(
            dtype
        )
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_parquet_roundtrip_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    batch = Batch({"x": random_tensor(shape, dtype)}, {})
    back = roundtrip(batch)
    assert back.tensors["x"].dtype == dtype and back.tensors["x"].shape == shape
    assert Batch.equal(back, batch)
    assert back.content_hash() == batch.content_hash()


def test_parquet_roundtrip_raw_bits() -> None:
    """NaN payloads and odd dtypes survive: values are stored bit for bit."""
    payload_nan = torch.tensor([0x7FC1, 0x7F81, -0x41], dtype=torch.int16).view(torch.bfloat16)
    f32_nan = torch.tensor([0x7FC00001, -1, 0], dtype=torch.int32).view(torch.float32)
    batch = Batch(
        {
            "bf16": payload_nan,
            "f32": f32_nan,
            "f8": torch.randn(3, 2).to(torch.float8_e4m3fn),
            "u16": torch.tensor([0, 1, 65535], dtype=torch.int32).to(torch.uint16),
            "i64": torch.tensor([-(2**63), 2**63 - 1, 0]),
        },
        {},
    )
    back = roundtrip(batch)
    assert Batch.equal(back, batch)
    assert back.tensors["bf16"].view(torch.int16).tolist() == [0x7FC1, 0x7F81, -0x41]


def test_parquet_roundtrip_columns_and_meta() -> None:
    columns: dict[str, list[Any]] = {
        "text": ["hello", "", None, "naïve ✓"],
        "reward": [1.0, -0.0, math.nan, None],
        "count": [1, -(2**63), 2**63 - 1, None],
        "flag": [True, False, None, True],
        "ids": [[1, 2, 3], [], None, [4]],
        "info": [{"a": 1, "b": [1.5, None]}, None, {"z": {"y": "x"}}, {}],
        "mixed": [1, 2.5, "three", [4]],
        "int_and_bool": [1, True, 0, False],
        "huge": [2**70, 1, 2, 3],
        "nones": [None] * 4,
        "nested": [[[1]], [[2, 3]], [], None],
    }
    meta = {"iteration": 7, "kl_coef": 0.001, "note": "ok", "stages": ["rollout", "reward"]}
    batch = Batch({"x": torch.arange(4)}, columns, meta)
    back = roundtrip(batch)
    assert Batch.equal(back, batch)
    assert back.content_hash() == batch.content_hash()
    assert back["text"] == columns["text"] and back["count"] == columns["count"]
    assert back["info"] == columns["info"] and back["mixed"] == columns["mixed"]
    assert [type(v) for v in back["int_and_bool"]] == [int, bool, int, bool]
    assert back["huge"][0] == 2**70
    assert back.meta == meta
    assert back.keys() == batch.keys()  # order kept


def test_parquet_path_and_file_objects(tmp_path: Path) -> None:
    batch = make_batch(4)
    path = tmp_path / "rollout.parquet"
    batch.to_parquet(path)
    assert Batch.equal(Batch.from_parquet(path), batch)
    assert Batch.equal(Batch.from_parquet(str(path)), batch)
    with open(tmp_path / "f.parquet", "wb") as f:
        batch.to_parquet(f)
    with open(tmp_path / "f.parquet", "rb") as f:
        assert Batch.equal(Batch.from_parquet(f), batch)
    buffer = io.BytesIO(batch.to_parquet_bytes())
    assert Batch.equal(Batch.from_parquet(buffer), batch)


def test_parquet_is_readable_by_pandas_and_pyarrow() -> None:
    texts = ["The answer is 4.", "I think 5", "4"]
    batch = Batch(
        {"response_ids": torch.tensor([[5, 6], [7, 8], [9, 10]]), "logp": torch.randn(3, 2).bfloat16()},
        {
            "responses": texts,
            "reward": [1.0, 0.0, 1.0],
            "tokens": [[1, 2, 3], [4], []],
            "info": [{"acc": 1}, {"acc": 0}, None],
        },  # fmt: skip
        {"iteration": 2},
    )
    data = batch.to_parquet_bytes()
    df = read_pandas(data)
    assert df["responses"].tolist() == texts
    assert all(isinstance(v, str) for v in df["responses"])
    assert df["reward"].dtype == "float64" and df["reward"].tolist() == [1.0, 0.0, 1.0]
    assert [list(v) for v in df["response_ids"]] == [[5, 6], [7, 8], [9, 10]]
    assert [list(v) for v in df["tokens"]] == [[1, 2, 3], [4], []]
    assert df["info"].tolist()[0] == '{"acc": 1}'  # JSON text, readable
    schema = pq.ParquetFile(io.BytesIO(data)).schema_arrow
    assert schema.field("responses").type == pa.string()
    assert schema.field("response_ids").type == pa.list_(pa.int64(), 2)
    assert schema.field("tokens").type == pa.list_(pa.int64())
    assert schema.field("logp").type == pa.list_(pa.uint16(), 2)  # bf16 raw bits
    assert b"rlflow" in schema.metadata


def test_parquet_empty_and_zero_size_rows() -> None:
    empty = make_batch(0)
    back = roundtrip(empty)
    assert len(back) == 0 and Batch.equal(back, empty)
    assert back.tensors["logp"].shape == (0, 4) and back.tensors["logp"].dtype == torch.bfloat16
    zero_width = Batch({"x": torch.zeros(3, 0, 2), "y": torch.arange(3)}, {"c": ["a", "b", "c"]})
    assert Batch.equal(roundtrip(zero_width), zero_width)
    no_keys = Batch({}, {}, {"iteration": 1})
    assert Batch.equal(roundtrip(no_keys), no_keys)


def test_empty_batch_split_and_concat() -> None:
    empty = make_batch(0)
    shards, pad = empty.split(3)
    assert pad == 0 and [len(s) for s in shards] == [0, 0, 0]
    assert Batch.equal(Batch.concat(shards), empty)
    assert Batch.equal(Batch.concat([empty, make_batch(2)]), make_batch(2))


def test_parquet_errors() -> None:
    with pytest.raises(TypeError, match="complex"):
        Batch({"z": torch.zeros(2, dtype=torch.complex64)}, {}).to_parquet_bytes()
    with pytest.raises(TypeError, match="column 'c' row 1.*object"):
        Batch({}, {"c": [{"a": 1}, object()]}).to_parquet_bytes()
    plain = io.BytesIO()
    pq.write_table(pa.table({"a": [1, 2]}), plain)
    with pytest.raises(ValueError, match="not an rlflow Batch"):
        Batch.from_parquet_bytes(plain.getvalue())


@FAST
@given(
    size=st.integers(0, 6),
    trailing=st.lists(st.integers(1, 3), max_size=2),
    dtype=st.sampled_from(DTYPES),
    texts=st.lists(st.one_of(st.none(), st.text(max_size=5)), min_size=6, max_size=6),
    floats=st.lists(st.one_of(st.none(), st.floats(allow_nan=True)), min_size=6, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_parquet_roundtrip_property(
    size: int,
    trailing: list[int],
    dtype: torch.dtype,
    texts: list[str | None],
    floats: list[float | None],
    seed: int,
) -> None:
    batch = Batch(
        {"x": random_tensor((size, *trailing), dtype, seed)},
        {"text": texts[:size], "score": floats[:size]},
        {"seed": seed},
    )
    back = roundtrip(batch)
    assert Batch.equal(back, batch)
    assert back.content_hash() == batch.content_hash()


# ----------------------------------------------------------------- hashing


def test_content_hash_changes_with_any_content() -> None:
    batch = make_batch(4)
    base = batch.content_hash()
    assert len(base) == 64 and base == make_batch(4).content_hash()
    changed_value = batch.tensors["input_ids"].clone()
    changed_value[2, 1] += 1
    variants = [
        batch.with_tensors(input_ids=changed_value),
        batch.with_tensors(input_ids=batch.tensors["input_ids"].int()),  # dtype
        batch.with_tensors(input_ids=batch.tensors["input_ids"].view(4, 2, 2)),  # shape, same bytes
        batch.with_tensors(mask=~batch.tensors["mask"]),
        batch.with_columns(prompt=["prompt 0", "prompt 1", "prompt 2", "prompt 4"]),
        batch.with_columns(info=[{"b": 0}] * 4),
        batch.with_meta(iteration=4),
        batch.with_meta(extra=None),
        batch.select("row", "input_ids", "logp", "mask", "prompt"),  # a key dropped
        Batch({"Row" if k == "row" else k: t for k, t in batch.tensors.items()}, batch.columns, batch.meta),
        Batch({}, {"c": [1]}),
    ]
    hashes = {v.content_hash() for v in variants}
    assert base not in hashes and len(hashes) == len(variants)
    assert Batch({}, {"c": [1]}).content_hash() != Batch({}, {"c": [1.0]}).content_hash()


def test_content_hash_ignores_key_order_and_layout() -> None:
    batch = make_batch(4)
    reordered = Batch(
        dict(reversed(batch.tensors.items())), dict(reversed(batch.columns.items())), batch.meta
    )
    assert reordered.content_hash() == batch.content_hash()
    strided = torch.arange(8).view(4, 2).t().contiguous().t()  # non-contiguous [4, 2]
    a = Batch({"x": strided}, {})
    b = Batch({"x": strided.contiguous()}, {})
    assert a.content_hash() == b.content_hash()


# ------------------------------------------------------------------- layers


def test_batch_imports_only_torch_pyarrow_numpy_and_stdlib() -> None:
    """infra/ imports engine.batch, so it must not pull in anything else of the project."""
    import sys

    source = Path(__file__).parents[1] / "engine" / "batch.py"
    tree = ast.parse(source.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    allowed = {"torch", "pyarrow", "numpy", "__future__"} | set(sys.stdlib_module_names)
    assert roots <= allowed, roots - allowed
