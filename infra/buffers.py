"""Sample buffers: a `Batch` per (iteration, stage) as one parquet object, and the `BufferRef`
that stages pass to each other (through Prefect results: small, JSON-able, no tensors).

    ref = write_buffer(store, "run1", 7, "rollout", batch)    # buffers/iter_000007/rollout.parquet
    batch = read_buffer(store, ref)                           # verified against ref.sha256

`sha256` is `Batch.content_hash()`: the content, independent of the parquet encoding. The parquet
object is written atomically (a reader never sees part of it), then `<name>.ref.json` next to it,
so a buffer whose ref file exists is complete and its hash is known (`load_ref`), e.g. to replay an
update from the persisted advantage buffer without the Prefect result. The parquet file opens
directly with pandas / pyarrow.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from engine.batch import Batch
from infra import layout
from infra.errors import CorruptRecordError, IntegrityError, ObjectNotFound
from infra.records import Count, Sha256, parse_record
from infra.store import ObjectStore


class BufferRef(BaseModel):
    """Where a buffer is and what it holds. JSON-able (`model_dump()`), immutable, hashable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uri: str
    sha256: Sha256
    rows: Count
    columns: tuple[str, ...]


def buffer_key(run_id: str, iteration: int, name: str) -> str:
    """`<run_id>/buffers/iter_000007/<name>.parquet`."""
    layout.check_run_id(run_id)
    return f"{run_id}/{layout.BUFFERS_DIR}/{layout.iter_dir(iteration)}/{layout.check_buffer_name(name)}.parquet"


def write_buffer(store: ObjectStore, run_id: str, iteration: int, name: str, batch: Batch) -> BufferRef:
    """Write `batch` as the `name` buffer of `iteration`; replaces an earlier one atomically."""
    key = buffer_key(run_id, iteration, name)
    ref = BufferRef(uri=store.url(key), sha256=batch.content_hash(), rows=len(batch),
                    columns=tuple(batch.keys()))
    store.put_bytes(key, batch.to_parquet_bytes())
    store.put_bytes(_ref_key(key), ref.model_dump_json(indent=1).encode())
    return ref


def read_buffer(store: ObjectStore, ref: BufferRef) -> Batch:
    """The Batch of `ref`, verified: `IntegrityError` naming the uri if it does not match."""
    key = store.key_of(ref.uri)
    data = store.get_bytes(key)
    try:
        batch = Batch.from_parquet_bytes(data)
    except Exception as err:  # noqa: BLE001 - any decoding failure is corruption here
        raise IntegrityError(f"buffer {ref.uri} is not a readable rlflow parquet file: {err}") from err
    actual = batch.content_hash()
    if actual != ref.sha256 or len(batch) != ref.rows:
        raise IntegrityError(f"buffer {ref.uri} does not match its reference: sha256 {actual[:12]}… "
                             f"rows {len(batch)}, expected {ref.sha256[:12]}… rows {ref.rows}")
    return batch


def recorded_metric(store: ObjectStore, ref: BufferRef, metric: str, why: str) -> float:
    """A metric the buffer of `ref` records with its rows (meta["metrics"]): a finite number, else
    CorruptRecordError naming the buffer, the metric and `why` it is needed (whoever writes the bucket
    writes these too)."""
    recorded = read_buffer(store, ref).meta.get("metrics")
    value = recorded.get(metric) if isinstance(recorded, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CorruptRecordError(f"{ref.uri} records {metric}={value!r}, not a finite number ({why})")
    return float(value)


def load_ref(store: ObjectStore, run_id: str, iteration: int, name: str) -> BufferRef | None:
    """The ref written with a buffer, or None when that buffer was never completely written."""
    try:
        data = store.get_bytes(_ref_key(buffer_key(run_id, iteration, name)))
    except ObjectNotFound:
        return None
    url = store.url(_ref_key(buffer_key(run_id, iteration, name)))
    ref = parse_record(BufferRef, data, url, "buffer reference")  # total: CorruptRecordError naming it
    return ref.model_copy(update={"uri": store.url(buffer_key(run_id, iteration, name))})


def _ref_key(parquet_key: str) -> str:
    return parquet_key.removesuffix(".parquet") + ".ref.json"
