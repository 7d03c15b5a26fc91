"""`Batch`: the typed record passed between stages and written to sample buffers.

A Batch holds B rows. Per-row data is either a tensor (leading dim B, any dtype, any trailing
shape) or a plain Python column (a list of B JSON-able values: prompts, response text, reward
info). Batch-level facts (iteration, kl_coef) live in `meta`.

Operations never copy more than they must: `select`, `with_*`, `to`, slicing `index` and
`chunks` share tensor storage and column values with their source, like tensor views do.
Treat a Batch's contents as read-only and build new Batches with `with_tensors`/`with_columns`.

Parquet layout (one file per buffer, readable by pandas/pyarrow as is):
  - a [B] tensor is a native column (bfloat16 and other types without an arrow equivalent are
    stored as their raw bits in an unsigned integer of the same width);
  - a [B, *S] tensor is a fixed-size-list column whose row holds that row's prod(S) values,
    flattened in C order;
  - a column whose values are all str / all int / all float / all bool (None allowed), or all
    lists of one of those, is a native arrow column; anything else is one JSON string per row;
  - schema metadata key ``rlflow`` holds the format version, B, meta and, per key, the dtype,
    trailing shape and encoding needed to rebuild the Batch exactly.

Only torch, pyarrow, numpy and the standard library are imported: `infra/` imports this module.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import operator
import os
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

FORMAT_VERSION = 1
METADATA_KEY = b"rlflow"
_HASH_DOMAIN = b"rlflow.Batch.v1"

# torch dtypes that arrow (and parquet) store natively; everything else is stored as raw bits.
_NATIVE_TENSOR_DTYPES = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.float32, torch.float64,
}  # fmt: skip
# Same-width integer dtypes used to reinterpret a tensor's bits (equality, hashing, storage).
_SIGNED_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Python scalar types with an exact native arrow type.
_ARROW_SCALARS: dict[type, pa.DataType] = {
    str: pa.string(), bool: pa.bool_(), int: pa.int64(), float: pa.float64(),
}  # fmt: skip
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

Index = Sequence[int] | torch.Tensor | slice
PathOrFile = str | os.PathLike[str] | IO[bytes]


@dataclass(eq=False, repr=False)
class Batch:
    """B rows of tensors and plain columns, plus batch-level `meta`.

    Attributes:
        tensors: name -> tensor of shape [B, *S] (any dtype, any trailing shape S).
        columns: name -> list of B JSON-able values (str, int, float, bool, None, dict, list).
        meta: batch-level JSON-able info, not per row (e.g. ``{"iteration": 7}``).

    Names are unique across tensors and columns. ``a == b`` is `Batch.equal(a, b)`.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    columns: dict[str, list[Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_types(self.tensors, self.columns, self.meta)
        _check_lengths(self.tensors, self.columns)

    # ----------------------------------------------------------------- access

    def __len__(self) -> int:
        """B, the number of rows (0 for a Batch without keys)."""
        for t in self.tensors.values():
            return t.shape[0]
        for col in self.columns.values():
            return len(col)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor | list[Any]:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.columns:
            return self.columns[key]
        raise KeyError(f"no key {key!r} in Batch; available: {self.keys()}")

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.columns

    def keys(self) -> list[str]:
        """Tensor keys then column keys, in insertion order."""
        return self.tensor_keys + self.column_keys

    @property
    def tensor_keys(self) -> list[str]:
        return list(self.tensors)

    @property
    def column_keys(self) -> list[str]:
        return list(self.columns)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Batch):
            return NotImplemented
        return Batch.equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # mutable container, like dict

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {_describe(t.dtype, t.shape[1:])}" for k, t in self.tensors.items())
        return f"Batch(B={len(self)}, tensors={{{tensors}}}, columns={self.column_keys}, meta={self.meta})"

    # ------------------------------------------------------- building new ones

    def _new(self, tensors: dict[str, torch.Tensor], columns: dict[str, list[Any]]) -> Batch:
        """A Batch of the same class with this one's meta (shallow-copied)."""
        return type(self)(tensors, columns, dict(self.meta))

    def select(self, *keys: str) -> Batch:
        """A Batch with only `keys` (tensors and columns alike); meta is kept."""
        if not keys:
            raise ValueError(f"select needs at least one key; available: {self.keys()}")
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"select: no such keys {missing}; available: {self.keys()}")
        tensors = {k: self.tensors[k] for k in keys if k in self.tensors}
        columns = {k: self.columns[k] for k in keys if k in self.columns}
        return self._new(tensors, columns)

    def with_tensors(self, **tensors: torch.Tensor) -> Batch:
        """A Batch with `tensors` added or replaced; each must have leading dim B."""
        return self._new({**self.tensors, **tensors}, dict(self.columns))

    def with_columns(self, **columns: list[Any]) -> Batch:
        """A Batch with `columns` added or replaced; each must have B values."""
        return self._new(dict(self.tensors), {**self.columns, **columns})

    def with_meta(self, **meta: Any) -> Batch:
        """A Batch with `meta` keys added or replaced; rows are shared."""
        return type(self)(dict(self.tensors), dict(self.columns), {**self.meta, **meta})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A Batch with every tensor moved to `device`; columns and meta are unchanged."""
        tensors = {k: t.to(device, non_blocking=non_blocking) for k, t in self.tensors.items()}
        return self._new(tensors, dict(self.columns))

    # ---------------------------------------------------------- row selection

    def index(self, idx: Index) -> Batch:
        """Rows `idx` of this Batch, in that order.

        Args:
            idx: a slice (contiguous slices give views), a list of ints (negative counts from
                the end; repeats allowed), a LongTensor [N], or a bool mask [B].
        """
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step > 0:  # torch slices only with a positive step; these are views
                return self._new(
                    {k: t[start:stop:step] for k, t in self.tensors.items()},
                    {k: col[start:stop:step] for k, col in self.columns.items()},
                )
            idx = list(range(start, stop, step))
        positions = _positions(idx, len(self))  # LongTensor [N] on CPU, in [0, B)
        rows = positions.tolist()
        return self._new(
            {k: t.index_select(0, positions.to(t.device)) for k, t in self.tensors.items()},
            {k: [col[i] for i in rows] for k, col in self.columns.items()},
        )

    def repeat_interleave(self, n: int) -> Batch:
        """Each row repeated `n` times consecutively (group sampling): [B] -> [B*n], rows
        r0,r0,..,r1,r1,.. so that rows b*n .. b*n+n-1 are the group of original row b."""
        if n < 1:
            raise ValueError(f"repeat_interleave needs n >= 1, got {n}")
        return self._new(
            {k: t.repeat_interleave(n, dim=0) for k, t in self.tensors.items()},
            {k: [v for v in col for _ in range(n)] for k, col in self.columns.items()},
        )

    def chunks(self, size: int) -> list[Batch]:
        """Consecutive mini-batches of `size` rows (views); the last may be smaller.
        An empty Batch gives no chunks."""
        if size <= 0:
            raise ValueError(f"chunk size must be > 0, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def shuffle(self, generator: torch.Generator) -> Batch:
        """The rows in a random order drawn from `generator` (a CPU generator)."""
        return self.index(torch.randperm(len(self), generator=generator))

    # --------------------------------------------------- data-parallel sharding

    def split(self, n: int) -> tuple[list[Batch], int]:
        """`n` equal shards (one per data-parallel rank) and the number of padding rows.

        If B % n != 0 the Batch is first padded to a multiple of n by repeating rows from the
        start, wrapping around (verl `protocol.py` pad_dataproto_to_divisor). Undo with
        ``Batch.unpad(Batch.concat(shards), pad)``. An empty Batch gives n empty shards.
        """
        if n < 1:
            raise ValueError(f"split needs n >= 1, got {n}")
        size = len(self)
        if size == 0:
            return [self.index(slice(0, 0)) for _ in range(n)], 0
        pad = -size % n
        padded = self if pad == 0 else self.index(list(range(size)) + [i % size for i in range(pad)])
        shard = (size + pad) // n
        return [padded.index(slice(r * shard, (r + 1) * shard)) for r in range(n)], pad

    @staticmethod
    def unpad(batch: Batch, pad: int) -> Batch:
        """`batch` without its last `pad` rows (the padding added by `split`)."""
        if not 0 <= pad <= len(batch):
            raise ValueError(f"unpad: pad must be in [0, {len(batch)}], got {pad}")
        return batch.index(slice(0, len(batch) - pad))

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Rows of `batches` one after another. All must have the same keys, and each tensor
        the same dtype and trailing shape. Meta is taken from the first batch."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, other in enumerate(batches[1:], start=1):
            _check_same_schema(first, other, i)
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        columns = {k: [v for b in batches for v in b.columns[k]] for k in first.columns}
        return cls(tensors, columns, dict(first.meta))

    # --------------------------------------------------------------- equality

    @staticmethod
    def equal(a: Batch, b: Batch) -> bool:
        """Exact equality: same keys, tensor dtypes, shapes and bits (so NaN equals the same
        NaN and -0.0 differs from 0.0), same column values and meta (compared as canonical JSON,
        so 1 differs from 1.0 and True)."""
        if set(a.tensors) != set(b.tensors) or set(a.columns) != set(b.columns):
            return False
        for key, ta in a.tensors.items():
            tb = b.tensors[key]
            if ta.dtype != tb.dtype or ta.shape != tb.shape:
                return False
            if not torch.equal(_bits(ta.cpu()), _bits(tb.cpu())):
                return False
        if any(not _json_equal(col, b.columns[key]) for key, col in a.columns.items()):
            return False
        return _json_equal(a.meta, b.meta)

    def content_hash(self) -> str:
        """sha256 hex of the content, independent of any file encoding.

        Covers B, every key (sorted) with its dtype, shape and raw little-endian tensor bytes,
        the canonical JSON of every column, and the canonical JSON of meta.
        """
        h = hashlib.sha256(_HASH_DOMAIN)
        _hash_part(h, _canonical_json({"B": len(self)}).encode())
        for key in sorted(self.tensors):
            t = self.tensors[key]
            header = {"tensor": key, "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
            _hash_part(h, _canonical_json(header).encode())
            _hash_part(h, _le_bytes(t))
        for key in sorted(self.columns):
            _hash_part(h, _canonical_json({"column": key}).encode())
            _hash_part(h, _canonical_json(self.columns[key], what=f"column {key!r}").encode())
        _hash_part(h, _canonical_json(self.meta, what="meta").encode())
        return h.hexdigest()

    # ---------------------------------------------------------------- parquet

    def to_arrow(self) -> pa.Table:
        """An arrow table with one column per key and the `rlflow` schema metadata."""
        fields: dict[str, pa.Array] = {}
        tensor_info: dict[str, dict[str, Any]] = {}
        column_info: dict[str, dict[str, Any]] = {}
        for key, t in self.tensors.items():
            fields[key], tensor_info[key] = _tensor_to_arrow(key, t)
        for key, col in self.columns.items():
            fields[key], column_info[key] = _column_to_arrow(key, col)
        info = {
            "version": FORMAT_VERSION,
            "B": len(self),
            "tensors": tensor_info,
            "columns": column_info,
            "meta": self.meta,
        }
        metadata = {METADATA_KEY: _json_dumps(info, what="meta").encode()}
        return pa.table(fields, metadata=metadata) if fields else pa.table({}, metadata=metadata)

    @classmethod
    def from_arrow(cls, table: pa.Table) -> Batch:
        """The Batch written by `to_arrow` (or read back from its parquet file)."""
        info = _read_info(table)
        tensors = {
            key: _tensor_from_arrow(key, table, spec, info["B"]) for key, spec in info["tensors"].items()
        }
        columns = {key: _column_from_arrow(key, table, spec) for key, spec in info["columns"].items()}
        return cls(tensors, columns, info["meta"])

    def to_parquet(self, path_or_file: PathOrFile) -> None:
        """Write the Batch as one parquet file to a path or a binary file object (e.g. fsspec)."""
        table = self.to_arrow()
        # Dictionary encoding only for strings: arrow's float dictionary treats every NaN
        # (and possibly -0.0/0.0) as one value, which would lose raw bits.
        dictionary = [k for k, f in zip(table.column_names, table.schema) if pa.types.is_string(f.type)]
        if isinstance(path_or_file, os.PathLike):
            path_or_file = os.fspath(path_or_file)
        pq.write_table(table, path_or_file, use_dictionary=dictionary)

    @classmethod
    def from_parquet(cls, path_or_file: PathOrFile) -> Batch:
        """Read a Batch from a parquet path or a binary file object written by `to_parquet`."""
        if isinstance(path_or_file, os.PathLike):
            path_or_file = os.fspath(path_or_file)
        # use_threads=False: with torch loaded, arrow's decode threads can abort the process
        # at interpreter exit (apache/arrow#34314); one buffer decodes fast on one thread.
        return cls.from_arrow(pq.ParquetFile(path_or_file).read(use_threads=False))

    def to_parquet_bytes(self) -> bytes:
        """The parquet file of `to_parquet`, as bytes."""
        out = io.BytesIO()
        self.to_parquet(out)
        return out.getvalue()

    @classmethod
    def from_parquet_bytes(cls, data: bytes) -> Batch:
        """The Batch in parquet file bytes written by `to_parquet_bytes`."""
        return cls.from_parquet(pa.BufferReader(data))


# ===================================================================== validation


def response_lengths(batch: Batch) -> torch.Tensor:
    """[B] each response's length, the one definition every length uses (DAPO's overlong shaping,
    response_length/*, its clip ratio, the micro-batch order): its tokens counted against
    rollout.max_new_tokens, those generated and, in a multi-turn response, the tools' observations
    between them (not trained on, but they take the same room), never its padding. That is the
    response's columns of the attention mask; the response mask holds only the trained tokens. Reads
    those two columns."""
    t = batch.tensors["response_mask"].shape[1]
    return batch.tensors["attention_mask"][:, -t:].sum(-1)


def _check_types(tensors: Any, columns: Any, meta: Any) -> None:
    if not isinstance(tensors, dict) or not isinstance(columns, dict) or not isinstance(meta, dict):
        raise TypeError("Batch tensors, columns and meta must be dicts")
    for key, t in tensors.items():
        if not isinstance(key, str):
            raise TypeError(f"Batch keys must be str, got {key!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {key!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.dim() == 0:
            raise ValueError(f"tensor {key!r} is 0-d; it needs a leading batch dim B")
    for key, col in columns.items():
        if not isinstance(key, str):
            raise TypeError(f"Batch keys must be str, got {key!r}")
        if not isinstance(col, list):
            raise TypeError(
                f"column {key!r} is a {type(col).__name__}, not a list (use a tensor for numeric arrays)"
            )
    both = sorted(set(tensors) & set(columns))
    if both:
        raise ValueError(f"keys {both} are both tensors and columns; names must be unique")


def _check_lengths(tensors: dict[str, torch.Tensor], columns: dict[str, list[Any]]) -> None:
    lengths = [(k, t.shape[0], "tensor") for k, t in tensors.items()]
    lengths += [(k, len(c), "column") for k, c in columns.items()]
    if not lengths:
        return
    first_key, size, first_kind = lengths[0]
    for key, length, kind in lengths[1:]:
        if length != size:
            raise ValueError(
                f"{kind} {key!r} has length {length} but B={size} (from {first_kind} {first_key!r})"
            )


def _check_same_schema(first: Batch, other: Batch, i: int) -> None:
    """Raise naming the first difference in keys, dtypes or trailing shapes."""
    problems = []
    for kind, a, b in (("tensors", first.tensors, other.tensors), ("columns", first.columns, other.columns)):
        missing, extra = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        if missing:
            problems.append(f"missing {kind} {missing}")
        if extra:
            problems.append(f"extra {kind} {extra}")
    for key in first.tensors.keys() & other.tensors.keys():
        ta, tb = first.tensors[key], other.tensors[key]
        if ta.dtype != tb.dtype or ta.shape[1:] != tb.shape[1:]:
            problems.append(
                f"tensor {key!r} is {_describe(tb.dtype, tb.shape[1:])}"
                f" but {_describe(ta.dtype, ta.shape[1:])} in batch 0"
            )
    if problems:
        raise ValueError(f"concat: batch {i} does not match batch 0: " + "; ".join(problems))


def _positions(idx: Sequence[int] | torch.Tensor, size: int) -> torch.Tensor:
    """Row positions as a CPU LongTensor [N] in [0, size), negatives counted from the end."""
    if isinstance(idx, torch.Tensor):
        idx = idx.cpu()
        if idx.dtype == torch.bool:
            if idx.shape != (size,):
                raise IndexError(f"bool mask has shape {tuple(idx.shape)}, expected ({size},)")
            return idx.nonzero().squeeze(1)
        if idx.dim() != 1 or idx.is_floating_point() or idx.is_complex():
            raise TypeError(f"index tensor must be an integer [N] tensor, got {idx.dtype}{list(idx.shape)}")
        positions = idx.long()
    elif isinstance(idx, int):
        raise TypeError("index takes a list, tensor or slice of rows; use [i] for one row")
    else:
        positions = torch.tensor([operator.index(i) for i in idx], dtype=torch.long)
    if positions.numel() and (positions.min() < -size or positions.max() >= size):
        bad = positions[(positions < -size) | (positions >= size)][0].item()
        raise IndexError(f"row index {bad} out of range for B={size}")
    return torch.where(positions < 0, positions + size, positions)


# ================================================================ bits and JSON


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(dtype: torch.dtype, trailing: Iterable[int]) -> str:
    return f"{_dtype_name(dtype)}[B{''.join(f', {d}' for d in trailing)}]"


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in parquet metadata")
    return dtype


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` reinterpreted as a signed integer tensor of the same width (same shape)."""
    if t.is_complex():
        t = torch.view_as_real(t)  # [..., 2] of the real dtype
    width = t.element_size()
    if width not in _SIGNED_OF_WIDTH:
        raise TypeError(f"unsupported tensor dtype {t.dtype}")
    return t.view(_SIGNED_OF_WIDTH[width])


def _le_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of `t` in contiguous C order, little-endian, as a uint8 array."""
    arr = _bits(t.detach().cpu()).contiguous().numpy()
    if sys.byteorder != "little":
        arr = arr.byteswap()
    return arr.reshape(-1).view(np.uint8)


def _hash_part(h: Any, data: bytes | np.ndarray) -> None:
    """Feed one length-prefixed part, so part boundaries are unambiguous."""
    h.update(struct.pack("<Q", len(data) if isinstance(data, bytes) else data.nbytes))
    h.update(data)


def _reject(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} value {value!r} is not JSON-able")


def _json_dumps(value: Any, what: str, canonical: bool = False) -> str:
    """JSON text of `value`; `canonical` sorts keys and drops whitespace."""
    try:
        if canonical:
            return json.dumps(
                value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_reject
            )
        return json.dumps(value, ensure_ascii=False, default=_reject)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: {e}") from e


def _canonical_json(value: Any, what: str = "value") -> str:
    return _json_dumps(value, what, canonical=True)


def _json_equal(a: Any, b: Any) -> bool:
    try:
        return _canonical_json(a) == _canonical_json(b)
    except TypeError:  # not JSON-able: fall back to Python equality
        return bool(a == b)


# ============================================================ arrow: tensors


def _tensor_to_arrow(key: str, t: torch.Tensor) -> tuple[pa.Array, dict[str, Any]]:
    """A [B, *S] tensor as an arrow column of B rows, and the metadata to rebuild it."""
    if t.is_complex():
        raise TypeError(f"tensor {key!r}: complex dtypes cannot be written to parquet")
    t = t.detach().cpu().contiguous()
    size, trailing = t.shape[0], list(t.shape[1:])
    if t.dtype in _NATIVE_TENSOR_DTYPES:
        values, encoding = t.numpy(), "native"
    else:  # bfloat16, float8, ...: the raw bits as an unsigned int of the same width
        values, encoding = _bits(t).numpy().view(_UNSIGNED_OF_WIDTH[t.element_size()]), "bits"
    flat = pa.array(values.reshape(-1))  # [B * prod(S)], C order
    row = math.prod(trailing)
    if not trailing:
        array = flat
    elif row > 0:
        array = pa.FixedSizeListArray.from_arrays(flat, row)  # [B] rows of prod(S) values
    else:  # arrow has no fixed-size list of size 0: B empty variable-size lists
        array = pa.ListArray.from_arrays(pa.array(np.zeros(size + 1, np.int32)), flat)
    info = {"dtype": _dtype_name(t.dtype), "shape": trailing, "encoding": encoding}
    return array, info


def _tensor_from_arrow(key: str, table: pa.Table, info: dict[str, Any], size: int) -> torch.Tensor:
    """The [B, *S] tensor stored in column `key` as described by `info`."""
    dtype, trailing = _torch_dtype(info["dtype"]), list(info["shape"])
    array = _column(table, key).combine_chunks()
    if trailing:
        array = array.flatten()  # [B * prod(S)]
    values = np.array(array.to_numpy(zero_copy_only=False), copy=True)
    if values.size != size * math.prod(trailing):
        raise ValueError(f"tensor {key!r}: {values.size} values in parquet, expected B*prod{trailing}")
    if info["encoding"] == "bits":
        values = values.view(np.dtype(f"int{values.itemsize * 8}"))  # signed: torch-compatible
        return torch.from_numpy(values).view(dtype).reshape(size, *trailing)
    return torch.from_numpy(values).to(dtype).reshape(size, *trailing)


# ============================================================ arrow: columns


def _column_to_arrow(key: str, values: list[Any]) -> tuple[pa.Array, dict[str, Any]]:
    """A column as a native arrow array when lossless, else one JSON string per row."""
    arrow_type = _native_arrow_type(values)
    if arrow_type is not None:
        return pa.array(values, type=arrow_type), {"encoding": "native"}
    texts = [None if v is None else _json_dumps(v, f"column {key!r} row {i}") for i, v in enumerate(values)]
    return pa.array(texts, type=pa.string()), {"encoding": "json"}


def _column_from_arrow(key: str, table: pa.Table, info: dict[str, Any]) -> list[Any]:
    values: list[Any] = _column(table, key).to_pylist()
    if info["encoding"] == "json":
        return [None if v is None else json.loads(v) for v in values]
    return values


def _native_arrow_type(values: list[Any]) -> pa.DataType | None:
    """The arrow type that stores `values` exactly: all str/int/float/bool (None allowed), or
    all lists of one such type; None when JSON is needed."""
    present = [v for v in values if v is not None]
    kind = _single_type(present)
    if kind in _ARROW_SCALARS:
        return _ARROW_SCALARS[kind] if _fits(kind, present) else None
    if kind is list:
        items = [x for v in present for x in v if x is not None]
        inner = _single_type(items)
        if inner in _ARROW_SCALARS and _fits(inner, items):
            return pa.list_(_ARROW_SCALARS[inner])
    return None


def _single_type(values: list[Any]) -> type | None:
    """The exact type shared by all `values` (subclasses count as different), else None."""
    types = {type(v) for v in values}
    return types.pop() if len(types) == 1 else None


def _fits(kind: type, values: list[Any]) -> bool:
    return kind is not int or all(_INT64_MIN <= v <= _INT64_MAX for v in values)


# ============================================================ arrow: metadata


def _column(table: pa.Table, key: str) -> pa.ChunkedArray:
    if key not in table.column_names:
        raise ValueError(f"parquet metadata lists {key!r} but the file has no such column")
    return table.column(key)


def _read_info(table: pa.Table) -> dict[str, Any]:
    metadata = table.schema.metadata or {}
    if METADATA_KEY not in metadata:
        raise ValueError("not an rlflow Batch: the parquet schema has no 'rlflow' metadata")
    info: dict[str, Any] = json.loads(metadata[METADATA_KEY])
    if info.get("version") != FORMAT_VERSION:
        raise ValueError(f"rlflow Batch format version {info.get('version')} is not {FORMAT_VERSION}")
    if table.num_rows != info["B"] and (info["tensors"] or info["columns"]):
        raise ValueError(f"parquet has {table.num_rows} rows but its metadata says B={info['B']}")
    return info
