"""A rank's part of a checkpoint: torch.distributed.checkpoint (DCP) through fsspec, hashed while it is
written, verified while it is read, and nothing unpickled from storage.

    files = save(url, {"model": ..., "optim": ...}, extra, storage_options)   # every rank
    # files: [{"path": "__0_0.distcp", "size": ..., "sha256": ...}, ...] this rank wrote, relative to url
    extra = load(url, state, storage_options, expected)                       # every rank

- Saving: the streams DCP and this module write are hashed as the bytes go out, so the commit
  (infra/checkpoints.py) writes the MANIFEST from these records without reading anything back.
- Loading: every file a rank opens is read once, in full, hashed and compared with `expected` (the
  MANIFEST's path -> (size, sha256)), then DCP reads it from memory (or a local spool file when large).
  A mismatch raises CheckpointCorruptError naming the file; the caller falls back to an older step.
- Whoever can write the bucket must not run code on the ranks: DCP's `.metadata` is a pickle, read
  here with an unpickler that builds only an explicit list of (module, name) pairs (DCP's metadata
  types, torch.Size and dtypes, paths), and DCP's byte items (and our extra state) are read with
  `torch.load(weights_only=True)`. `load_state` is the one DCP read of the project (a test checks).
"""

from __future__ import annotations

import enum
import hashlib
import io
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from engine.errors import EngineError

EXTRA = "extra_rank{rank}.pt"
IN_MEMORY_MAX = 256 * 2**20  # files up to this size are verified in memory; larger ones spool to local disk
_CHUNK = 8 * 2**20
FileRecord = dict[str, Any]  # {"path": relative to the save url, "size": int, "sha256": hex or None}


class CheckpointCorruptError(EngineError):
    """A checkpoint file does not match its manifest (size or sha256), or is not in it."""


# ------------------------------------------------------------------------------------------- save

def save(url: str, state: dict[str, Any], extra: dict[str, Any], storage_options: dict[str, Any], rank: int
         ) -> list[FileRecord]:
    """DCP-save `state` (every rank calls it) and this rank's `extra` (small: scheduler, RNG, version)
    under `url`; returns the files this rank wrote with their sizes and sha256."""
    written: list[FileRecord] = []
    writer = _writer(url, storage_options)
    writer.fs = _HashingFileSystem(writer.fs, str(writer.path), written.append)  # type: ignore[assignment]
    dcp.save(state, storage_writer=writer)
    buf = io.BytesIO()
    torch.save(extra, buf)
    data = buf.getvalue()
    name = EXTRA.format(rank=rank)
    with fsspec.open(f"{url.rstrip('/')}/{name}", "wb", **storage_options) as f:
        f.write(data)
    written.append({"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return _latest_names(written)


def _latest_names(records: list[FileRecord]) -> list[FileRecord]:
    # DCP writes .metadata.tmp, then renames it: the rename's record replaces the temporary name.
    renamed = {r["renamed_from"] for r in records if "renamed_from" in r}
    return [{k: v for k, v in r.items() if k != "renamed_from"} for r in records if r["path"] not in renamed]


def _writer(url: str, storage_options: dict[str, Any]) -> Any:
    if _remote(url):
        # A private module of torch (docs/internals.md lists every private name we use).
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(url, sync_files=False, **storage_options)  # no fsync on an object store
    return dcp.FileSystemWriter(url.removeprefix("file://"))


def _corruption_of_another_rank(err: BaseException) -> CheckpointCorruptError | None:
    """The CheckpointCorruptError among the ranks' failures that DCP's CheckpointException carries."""
    if not isinstance(err, CheckpointException):
        return None
    for rank, (exc, _) in sorted(err.failures.items()):
        if isinstance(exc, CheckpointCorruptError):
            return CheckpointCorruptError(f"{exc} (read by rank {rank})")
    return None


def _remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


# ------------------------------------------------------------------------------------------- load

def load(url: str, state: dict[str, Any], storage_options: dict[str, Any], rank: int,
         expected: dict[str, tuple[int, str]] | None = None) -> dict[str, Any]:
    """DCP-load into `state` (in place; every rank calls it) and return this rank's extra state.
    `expected`: path (relative to `url`) -> (size, sha256) of every file, from the manifest: each file
    is verified as it is read; None reads unverified (a checkpoint not committed through the store)."""
    load_state(url, state, storage_options, expected)
    name = EXTRA.format(rank=rank)
    if expected is not None and name not in expected:
        raise CheckpointCorruptError(f"{name} is not in the checkpoint's manifest")
    with fsspec.open(f"{url.rstrip('/')}/{name}", "rb", **storage_options) as f:
        data = f.read()
    _verify(name, data, expected)
    return torch.load(io.BytesIO(data), weights_only=True)  # type: ignore[no-any-return]


def load_state(url: str, state: dict[str, Any], storage_options: dict[str, Any],
               expected: dict[str, tuple[int, str]] | None = None) -> None:
    """DCP-load into `state` (in place) and nothing else: the one way this project reads DCP files (the
    metadata through the allow-listed unpickler, byte items with weights_only=True). In one process
    when torch.distributed is not initialised (a base checkpoint made into a model folder)."""
    reader = _reader(url, storage_options)
    verifying = _VerifyingFileSystem(reader.fs, str(reader.path), expected,
                                     fsspec.core.url_to_fs(url, **storage_options)[0] if _remote(url) else None)
    reader.fs = verifying
    try:
        dcp.load(state, storage_reader=reader, planner=_WeightsOnlyLoadPlanner())
    except BaseException as err:  # DCP's CheckpointException is a BaseException, and it may keep only text
        if verifying.failures:
            raise CheckpointCorruptError(str(verifying.failures[0])) from None
        # A file only another rank reads was corrupt: DCP gathers every rank's failure and raises them on
        # all ranks, so this rank reports the same corruption (the engine takes whichever rank answers
        # first: each must say why, or a fallback to an older checkpoint would depend on timing).
        if (corrupt := _corruption_of_another_rank(err)) is not None:
            raise corrupt from None
        if not isinstance(err, Exception):
            raise RuntimeError(f"loading the checkpoint at {url} failed: {err}") from None
        raise


def _verify(rel: str, data: bytes, expected: dict[str, tuple[int, str]] | None) -> None:
    if expected is None:
        return
    _check(rel, len(data), hashlib.sha256(data).hexdigest(), expected)


def _check(rel: str, size: int, sha: str, expected: dict[str, tuple[int, str]]) -> None:
    if rel not in expected:
        raise CheckpointCorruptError(f"{rel} is not in the checkpoint's manifest")
    want_size, want_sha = expected[rel]
    if size != want_size:
        raise CheckpointCorruptError(f"{rel} has {size} bytes, the manifest says {want_size}")
    if sha != want_sha:
        raise CheckpointCorruptError(f"{rel} is corrupt: sha256 {sha[:16]}..., the manifest says {want_sha[:16]}...")


def _reader(url: str, storage_options: dict[str, Any]) -> Any:
    if _remote(url):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return _SafeMetadata.wrap(FsspecReader(url, **storage_options))
    return _SafeMetadata.wrap(dcp.FileSystemReader(url.removeprefix("file://")))


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's byte items (non-tensor state: optimizer param groups, counters) read with weights_only=True,
    where DCP's own planner would run any pickle the storage holds."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _SafeMetadata:
    """`read_metadata` with an unpickler that builds DCP's metadata types and nothing else (the
    readers' own is `pickle.load`)."""

    @staticmethod
    def wrap(reader: Any) -> Any:
        def read_metadata(*args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with reader.fs.create_stream(reader.fs.concat_path(reader.path, name), "rb") as stream:
                try:
                    metadata = _MetadataUnpickler(stream).load()
                except CheckpointCorruptError as err:
                    reader.fs.failures.append(err)
                    raise
            if not isinstance(metadata, Metadata):
                raise CheckpointCorruptError(f"{name} holds a {type(metadata).__name__}, not DCP metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = reader.load_id
            return metadata

        reader.read_metadata = read_metadata
        return reader


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the (module, name) pairs below, each an exact name: a dotted name (protocol 4 resolves
    `os.system` as an attribute of an admitted module that imports os) is never admitted."""

    _METADATA = "torch.distributed.checkpoint.metadata"
    _NAMES = frozenset({
        (_METADATA, "Metadata"), (_METADATA, "MetadataIndex"), (_METADATA, "StorageMeta"),
        (_METADATA, "TensorProperties"), (_METADATA, "TensorStorageMetadata"),
        (_METADATA, "BytesStorageMetadata"), (_METADATA, "ChunkStorageMetadata"),
        (_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
    } | {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._NAMES:
            return super().find_class(module, name)
        if name == "getattr" and module in ("builtins", "__builtin__"):  # an Enum member, as Python 3.11.2 pickles it
            return _enum_member
        raise CheckpointCorruptError(f"DCP metadata refers to {module}.{name}, which is not a metadata type")


def _enum_member(cls: Any, name: Any) -> Any:
    """What `getattr` may do in DCP metadata: give a member of an admitted Enum class by its name
    (`_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT`, as Debian 12's Python 3.11.2 pickles it), nothing else."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise CheckpointCorruptError(f"DCP metadata calls getattr on {type(cls).__name__} {str(cls)[:60]!r} with "
                                 f"{str(name)[:60]!r}: only a member of a metadata Enum is allowed")


# ------------------------------------------------------------------------ hashing and verifying I/O

class _HashingFileSystem:
    """Wraps a DCP FileSystem: streams opened for writing are hashed as they are written, and a record
    (path relative to `base`, size, sha256) is reported when each closes."""

    def __init__(self, inner: Any, base: str, on_written: Callable[[FileRecord], None]) -> None:
        self._inner, self._base, self._on_written = inner, str(base).rstrip("/"), on_written
        self._written: dict[str, FileRecord] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _rel(self, path: Any) -> str:
        return _relative(path, self._base)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._inner.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
        # A stream written out of order has no usable hash: the commit then reads the file to hash it.
        record = {"path": self._rel(path), "size": hashing.size, "sha256": hashing.hexdigest() if hashing.valid else None}
        self._written[record["path"]] = record
        self._on_written(record)

    def rename(self, path: Any, new_path: Any) -> None:
        self._inner.rename(path, new_path)
        old = self._written.pop(self._rel(path), None)
        if old is not None:
            self._on_written({**old, "path": self._rel(new_path), "renamed_from": old["path"]})


class _HashingStream(io.RawIOBase):
    """Forwards writes to `inner` and hashes them. A seek makes the hash unusable."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner
        self._h = hashlib.sha256()
        self.size = 0
        self.valid = True

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._inner.write(view)
        written = len(view) if written is None else written
        self._h.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return int(self._inner.tell())

    def seekable(self) -> bool:
        return bool(self._inner.seekable())

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if (offset, whence) not in ((self.size, io.SEEK_SET), (0, io.SEEK_CUR)):
            self.valid = False
        return int(self._inner.seek(offset, whence))

    def flush(self) -> None:
        if not getattr(self._inner, "closed", False):
            self._inner.flush()

    def fileno(self) -> int:
        return int(self._inner.fileno())

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
        super().close()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class _VerifyingFileSystem:
    """Wraps a DCP FileSystem: a stream opened for reading is read once, in full (one GET of the whole
    object on an object store, through `remote`), hashed and checked against `expected`, then served
    from memory (or from a local spool file when large)."""

    def __init__(self, inner: Any, base: str, expected: dict[str, tuple[int, str]] | None, remote: Any = None
                 ) -> None:
        self._inner, self._base, self._expected, self._remote = inner, str(base).rstrip("/"), expected, remote
        self.failures: list[CheckpointCorruptError] = []  # DCP may keep only the text of an error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "r" not in mode or self._expected is None:
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        rel = _relative(path, self._base)
        if rel not in self._expected:  # never open what the manifest does not vouch for (nor let DCP say why)
            self.failures.append(CheckpointCorruptError(f"{rel} is not in the checkpoint's manifest"))
            raise self.failures[-1]
        spool = tempfile.SpooledTemporaryFile(max_size=IN_MEMORY_MAX)
        digest, size = hashlib.sha256(), 0
        # A file object over an object store reads in ranged GETs of its block size; one GET of the whole
        # object streams it at the store's full speed.
        opened = self._remote.open(str(path), "rb", block_size=max(_CHUNK, self._expected.get(rel, (0,))[0])) \
            if self._remote is not None else self._inner.create_stream(path, mode)
        # Hash and spool on a second thread while the next chunk arrives (hashlib and file writes release
        # the GIL): the verification costs no time beyond the download.
        with opened as stream, ThreadPoolExecutor(1) as pool:
            pending = None
            while chunk := stream.read(_CHUNK):
                if pending is not None:
                    pending.result()
                pending = pool.submit(_consume, digest, spool, chunk)
                size += len(chunk)
            if pending is not None:
                pending.result()
        try:
            try:
                _check(rel, size, digest.hexdigest(), self._expected)
            except CheckpointCorruptError as err:
                self.failures.append(err)
                raise
            spool.seek(0)
            yield spool
        finally:
            spool.close()


def _consume(digest: Any, spool: Any, chunk: bytes) -> None:
    digest.update(chunk)
    spool.write(chunk)


def _relative(path: Any, base: str) -> str:
    text = str(path)
    return text[len(base) + 1:] if text.startswith(base + "/") else os.path.basename(text)
