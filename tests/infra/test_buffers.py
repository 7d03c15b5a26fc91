"""Sample buffers on both backends: parquet objects, BufferRef, verification, pandas access."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from engine.batch import Batch
from infra.buffers import BufferRef, buffer_key, load_ref, read_buffer, write_buffer
from infra.errors import IntegrityError, StoreError
from infra.store import ObjectStore


def _batch(rows: int = 6) -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch(
        tensors={"responses": torch.randint(0, 100, (rows, 5), generator=g),
                 "old_logp": torch.randn(rows, 5, generator=g),
                 "scores": torch.randn(rows, generator=g)},
        columns={"prompt": [f"what is {i}+{i}?" for i in range(rows)], "uid": list(range(rows))},
        meta={"iteration": 7},
    )  # fmt: skip


def test_write_then_read_verifies(store: ObjectStore) -> None:
    batch = _batch()
    ref = write_buffer(store, "run1", 7, "rollout", batch)
    assert ref.uri == store.url("run1/buffers/iter_000007/rollout.parquet")
    assert ref.rows == 6 and ref.sha256 == batch.content_hash()
    assert set(ref.columns) == {"responses", "old_logp", "scores", "prompt", "uid"}
    assert read_buffer(store, ref) == batch


def test_ref_is_small_json(store: ObjectStore) -> None:
    ref = write_buffer(store, "run1", 7, "reward", _batch())
    again = BufferRef.model_validate(json.loads(json.dumps(ref.model_dump())))
    assert again == ref and hash(again) == hash(ref)
    with pytest.raises(Exception):
        ref.rows = 3  # frozen
    assert load_ref(store, "run1", 7, "reward") == ref
    assert load_ref(store, "run1", 8, "reward") is None


def test_a_changed_buffer_fails_naming_its_uri(store: ObjectStore) -> None:
    ref = write_buffer(store, "run1", 7, "rollout", _batch())
    key = store.key_of(ref.uri)
    # A different but valid batch written over it: the content hash catches it.
    store.put_bytes(key, _batch(rows=5).to_parquet_bytes())
    with pytest.raises(IntegrityError, match="rollout.parquet"):
        read_buffer(store, ref)
    # Flipped bytes: unreadable parquet or a hash mismatch, either way an IntegrityError.
    data = bytearray(_batch().to_parquet_bytes())
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(key, bytes(data))
    with pytest.raises(IntegrityError, match="rollout.parquet"):
        read_buffer(store, ref)


def test_opens_directly_with_pandas_and_pyarrow(store: ObjectStore) -> None:
    write_buffer(store, "run1", 7, "rollout", _batch())
    url = store.url("run1/buffers/iter_000007/rollout.parquet")
    df = pd.read_parquet(url)  # s3: the AWS_* environment (s3_env) points pandas at the server
    assert list(df["prompt"])[:2] == ["what is 0+0?", "what is 1+1?"]
    assert len(df) == 6 and len(df["responses"][0]) == 5
    with store.open("run1/buffers/iter_000007/rollout.parquet") as f:
        assert pq.read_table(f).num_rows == 6


def test_buffer_names_are_checked() -> None:
    with pytest.raises(StoreError, match="buffer name"):
        buffer_key("run1", 7, "../escape")
    with pytest.raises(StoreError, match="run id"):
        buffer_key("bad/run", 7, "rollout")
    assert buffer_key("run1", 7, "advantage") == "run1/buffers/iter_000007/advantage.parquet"
