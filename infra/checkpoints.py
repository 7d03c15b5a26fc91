"""Committed checkpoints: `checkpoints/step_NNNNNN/` + MANIFEST.json as the commit + LATEST.

The protocol the engine uses (docs/architecture.md "Object storage"):

    ckpts = CheckpointStore(store, run_id, keep_last=3, keep_every=0)
    url = ckpts.begin(7)                             # clears leftovers of a crashed save of step 7
    written = engine.save(url)                       # every rank: its shards, hashed while written
    ckpts.write_trainer_state(7, {"iteration": 7, ...})
    ckpts.commit(7, written)                         # MANIFEST from those hashes, then LATEST
    ...
    step = ckpts.restore(lambda step, manifest: engine.load(ckpts.step_url(step), expected=...))
                                                     # newest committed step whose files verify as read

The commit rule: a step folder without MANIFEST.json does not exist. MANIFEST lists every file under
the step with its size and sha256 and is written last (atomically), LATEST after it. A crash at any
point before the MANIFEST write leaves the previous committed step as the latest; its folder is
ignored, and removed by the next `begin` of that step or by retention.

Hashing costs no extra pass over the data: the engine's ranks hash what they write
(engine/state/checkpoint_io.py) and hand the records to `commit`; the store's own writers (`write_bytes`,
`put_file`, `put_dir`) hash while uploading, on a second thread, and leave a small record
(`.sha256/<random>.json`: path, size, sha256 of the files of that call; one per call, so writers never
collide) that `commit` collects. Only a file without a record of its size is read back and hashed at
commit. Loading verifies every file against the manifest as it is read: `restore` hands the manifest
to the loader (the engine's ranks check each file they read), `fetch` downloads and verifies in one
pass; a step that fails is skipped with a warning that names the bad file, and the previous
committed step is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra import layout
from infra.errors import CorruptRecordError, IntegrityError, ObjectNotFound, StoreError
from infra.records import Count, Sha256, TrainerStateRecord, parse_record
from infra.store import ObjectInfo, ObjectStore, sha256_file

log = logging.getLogger("rlflow.storage")

HASH_DIR = ".sha256"  # hash records left by the hashing writers, removed by commit
IN_MEMORY_MAX = 256 * 2**20  # files up to this size are hashed and moved in one read
_CHUNK = 8 * 2**20


class CheckpointFallbackWarning(UserWarning):
    """The newest committed checkpoint failed verification; an older one is used."""


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str  # relative to the step folder, POSIX
    size: Count
    sha256: Sha256

    @field_validator("path")
    @classmethod
    def _inside_the_step(cls, path: str) -> str:
        # `fetch` writes each file under the local folder by this path: no way out of it.
        parts = path.split("/")
        if not path or len(path) > 1024 or path.startswith("/") or any(p in ("", ".", "..") for p in parts) \
                or "\\" in path or any(ord(c) < 32 for c in path):
            raise ValueError(f"{path[:80]!r} is not a relative path inside the step folder")
        return path


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = 1
    step: Count
    created: Annotated[str, Field(max_length=64)]
    total_bytes: Count
    files: Annotated[list[FileEntry], Field(min_length=1)]  # commit refuses a step with no files


class _HashRecords(BaseModel):
    """A `.sha256/<random>.json` record of a hashing writer (`_record`)."""

    model_config = ConfigDict(extra="forbid")

    files: list[FileEntry]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint: `url` is where to read it (the store, or the local copy of `fetch`)."""

    step: int
    url: str
    manifest: Manifest
    trainer_state: dict[str, Any] | None


class CheckpointStore:
    """The checkpoints of one run. Every method is safe to call from any rank; `commit` and
    retention belong to one process (rank 0, holding the run's lease)."""

    def __init__(self, store: ObjectStore, run_id: str, keep_last: int = 3, keep_every: int = 0) -> None:
        if keep_last < 1 or keep_every < 0:
            raise StoreError(f"retention needs keep_last >= 1 and keep_every >= 0, got {keep_last}, {keep_every}")
        self.store = store
        self.run_id = layout.check_run_id(run_id)
        self.keep_last, self.keep_every = keep_last, keep_every

    def __repr__(self) -> str:
        return f"CheckpointStore({self.store!r}, {self.run_id!r})"

    # ---------------------------------------------------------------- names

    def _dir_key(self) -> str:
        return f"{self.run_id}/{layout.CHECKPOINTS_DIR}"

    def step_key(self, step: int, rel: str = "") -> str:
        key = f"{self._dir_key()}/{layout.step_dir(step)}"
        return f"{key}/{rel}" if rel else key

    def step_url(self, step: int, rel: str = "") -> str:
        return self.store.url(self.step_key(step, rel))

    # ---------------------------------------------------------------- write

    def begin(self, step: int, *, overwrite: bool = False) -> str:
        """Start saving `step`: remove what a crashed save left there, return the staging URL.

        A committed `step` is refused unless `overwrite` (which first un-commits it, so a crash
        while overwriting leaves the previous committed step as the latest)."""
        leftovers = [o.key for o in self.store.list(self.step_key(step))]
        manifest = self.step_key(step, layout.MANIFEST)
        if manifest in leftovers:
            if not overwrite:
                raise StoreError(f"checkpoint {self.step_url(step)} is already committed; "
                                 "save under a new step or pass overwrite=True")
            self.store.delete(manifest)
        self.store.delete_many([k for k in leftovers if k != manifest])
        return self.step_url(step)

    def write_bytes(self, step: int, rel: str, data: bytes) -> None:
        """Write one file of the checkpoint (hashed while it uploads)."""
        self._record(step, [self._put_bytes(step, rel, data)])

    def put_file(self, step: int, rel: str, local_path: str) -> None:
        """Upload one local file into the checkpoint (hashed while it uploads)."""
        self._record(step, [self._put_file(step, rel, local_path)])

    def put_dir(self, step: int, local_dir: str, rel: str = "") -> list[str]:
        """Upload every file under `local_dir` into the checkpoint (under `rel`), in parallel."""
        files = []
        for folder, _, names in os.walk(local_dir):
            for name in names:
                path = os.path.join(folder, name)
                inner = os.path.relpath(path, local_dir).replace(os.sep, "/")
                files.append((f"{rel.strip('/')}/{inner}" if rel.strip("/") else inner, path))
        entries = self.store.map_parallel(lambda item: self._put_file(step, *item), sorted(files))
        self._record(step, entries)
        return [e.path for e in entries]

    def _put_bytes(self, step: int, rel: str, data: bytes) -> FileEntry:
        # sha256 on a second thread while the upload runs (hashlib releases the GIL).
        with ThreadPoolExecutor(1) as pool:
            digest = pool.submit(hashlib.sha256, data)
            self.store.put_bytes(self.step_key(step, rel), data, checksum=False)  # sha256 is in MANIFEST
            return FileEntry(path=rel, size=len(data), sha256=digest.result().hexdigest())

    def _put_file(self, step: int, rel: str, local_path: str) -> FileEntry:
        if os.path.getsize(local_path) <= IN_MEMORY_MAX:  # one read of the file for both
            with open(local_path, "rb") as f:
                return self._put_bytes(step, rel, f.read())
        with ThreadPoolExecutor(1) as pool:  # large: stream it, hash from the page cache alongside
            digest = pool.submit(sha256_file, local_path)
            self.store.put_file(local_path, self.step_key(step, rel), checksum=False)
            size, sha = digest.result()
        return FileEntry(path=rel, size=size, sha256=sha)

    def write_trainer_state(self, step: int, state: dict[str, Any]) -> None:
        """trainer.json: what the train flow restores from this checkpoint (JSON-able; flows/train.py
        Trainer.trainer_state). The ranks' RNG and schedule state are in their own shards."""
        self.write_bytes(step, layout.TRAINER_JSON, json.dumps(state, indent=1, sort_keys=True).encode())

    def read_trainer_state(self, step: int) -> dict[str, Any] | None:
        """trainer.json of committed `step`, checked against the step's manifest (size and sha256) and
        parsed totally (infra.records.TrainerStateRecord); None when the step has none. IntegrityError
        (CorruptRecordError when it verifies but does not parse) naming it otherwise."""
        entry = next((f for f in self.read_manifest(step).files if f.path == layout.TRAINER_JSON), None)
        url = self.step_url(step, layout.TRAINER_JSON)
        try:
            data = self.store.get_bytes(self.step_key(step, layout.TRAINER_JSON))
        except ObjectNotFound:
            if entry is not None:
                raise IntegrityError(f"{url} is missing (listed in the manifest)") from None
            return None
        if entry is None:
            raise IntegrityError(f"{url} is not in the checkpoint's manifest")
        self._check(step, entry, len(data), hashlib.sha256(data).hexdigest())
        state = parse_record(TrainerStateRecord, data, url, "trainer state")
        if state.iteration != step:
            raise CorruptRecordError(f"{url} is not a valid trainer state: iteration {state.iteration} in step {step}")
        return state.model_dump(exclude_unset=True)

    def _record(self, step: int, entries: list[FileEntry]) -> None:
        """Leave the hashes of files just written for `commit`: one small object per writer call,
        uniquely named, so ranks never overwrite each other's records."""
        if entries:
            body = json.dumps({"files": [e.model_dump() for e in entries]}).encode()
            self.store.put_bytes(self.step_key(step, f"{HASH_DIR}/{uuid.uuid4().hex}.json"), body)

    # --------------------------------------------------------------- commit

    def commit(self, step: int, written: list[dict[str, Any]] | None = None) -> Manifest:
        """Write MANIFEST.json (every file under the step: path, size, sha256), then LATEST, then
        apply retention. `written`: records (path relative to the step, size, sha256) of files hashed
        as they were written elsewhere (the engine's ranks). Files without a matching record are read
        back and hashed here. Committing a committed step again (a retried task) only makes sure
        LATEST was written."""
        prefix = self.step_key(step)
        objects = self.store.list(prefix)
        if any(_rel(o, prefix) == layout.MANIFEST for o in objects):
            if self.latest_pointer() != step:
                self.store.put_bytes(f"{self._dir_key()}/{layout.LATEST}", f"{layout.step_dir(step)}\n".encode())
            return self.read_manifest(step)
        records = [o.key for o in objects if _rel(o, prefix).startswith(f"{HASH_DIR}/")]
        files = [o for o in objects if not _rel(o, prefix).startswith(f"{HASH_DIR}/")
                 and _rel(o, prefix) != layout.MANIFEST]  # fmt: skip
        if not files:
            raise StoreError(f"nothing to commit: no files under {self.step_url(step)} (call begin and write first)")
        known: dict[str, set[tuple[int, str]]] = {}
        for e in written or []:
            if e.get("sha256"):
                known.setdefault(e["path"], set()).add((int(e["size"]), e["sha256"]))
        for key, data in zip(records, self.store.map_parallel(self.store.get_bytes, records)):
            try:
                hashed = parse_record(_HashRecords, data, self.store.url(key), "hash record").files
            except CorruptRecordError as err:  # its files are hashed again from storage below
                log.warning("%s: ignored", err)
                continue
            for f in hashed:
                known.setdefault(f.path, set()).add((f.size, f.sha256))
        entries = self.store.map_parallel(lambda o: self._entry(o, prefix, known), files)
        manifest = Manifest(step=step, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            total_bytes=sum(e.size for e in entries), files=entries)
        self.store.put_bytes(self.step_key(step, layout.MANIFEST), manifest.model_dump_json(indent=1).encode())
        # Committed. What follows is tidying: a crash here leaves a valid, committed step.
        self.store.put_bytes(f"{self._dir_key()}/{layout.LATEST}", f"{layout.step_dir(step)}\n".encode())
        self.store.delete_many(records)
        self.apply_retention(latest=step)
        return manifest

    def _entry(self, obj: ObjectInfo, prefix: str, known: dict[str, set[tuple[int, str]]]) -> FileEntry:
        rel = _rel(obj, prefix)
        candidates = {sha for size, sha in known.get(rel, set()) if size == obj.size}
        if len(candidates) == 1:
            return FileEntry(path=rel, size=obj.size, sha256=candidates.pop())
        if rel in known:
            log.warning("the hash recorded for %s does not fit the stored file: hashing it again",
                        self.store.url(obj.key))
        size, sha = self._hash_stored(obj.key, obj.size)
        return FileEntry(path=rel, size=size, sha256=sha)

    def _hash_stored(self, key: str, size_hint: int) -> tuple[int, str]:
        if size_hint <= IN_MEMORY_MAX:
            data = self.store.get_bytes(key, checksum=False)
            return len(data), hashlib.sha256(data).hexdigest()
        h, size = hashlib.sha256(), 0
        with self.store.open(key, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
        return size, h.hexdigest()

    # ----------------------------------------------------------------- read

    def committed_steps(self) -> list[int]:
        """Steps with a MANIFEST.json, ascending."""
        steps = []
        for o in self.store.list(self._dir_key()):
            parts = _rel(o, self._dir_key()).split("/")
            if len(parts) == 2 and parts[1] == layout.MANIFEST:
                step = layout.parse_step_dir(parts[0])
                if step is not None:
                    steps.append(step)
        return sorted(steps)

    def is_committed(self, step: int) -> bool:
        return self.store.exists(self.step_key(step, layout.MANIFEST))

    def latest_committed(self) -> int | None:
        """The newest committed step (by its MANIFEST; LATEST is written after it and only lags
        when a crash fell between the two)."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def latest_pointer(self) -> int | None:
        """The step named in checkpoints/LATEST."""
        key = f"{self._dir_key()}/{layout.LATEST}"
        try:
            data = self.store.get_bytes(key)
        except ObjectNotFound:
            return None
        step = layout.parse_step_dir(data.decode("utf-8", errors="replace").strip()) if len(data) <= 64 else None
        if step is None:  # only a hint (the MANIFESTs decide what is committed): say so and go without it
            log.warning("%s does not name a step (%r): ignored", self.store.url(key), data[:64])
        return step

    def read_manifest(self, step: int) -> Manifest:
        try:
            data = self.store.get_bytes(self.step_key(step, layout.MANIFEST))
        except ObjectNotFound:
            raise ObjectNotFound(f"checkpoint {self.step_url(step)} is not committed (no {layout.MANIFEST})") from None
        url = self.step_url(step, layout.MANIFEST)
        manifest = parse_record(Manifest, data, url, "manifest")  # total: CorruptRecordError (an IntegrityError)
        paths = [f.path for f in manifest.files]
        if manifest.step != step:
            raise CorruptRecordError(f"{url} is not a valid manifest: it says step {manifest.step}")
        if len(set(paths)) != len(paths) or layout.MANIFEST in paths:
            raise CorruptRecordError(f"{url} is not a valid manifest: a path listed twice, or the manifest itself")
        if manifest.total_bytes != sum(f.size for f in manifest.files):
            raise CorruptRecordError(f"{url} is not a valid manifest: total_bytes {manifest.total_bytes} is not "
                                     "the sum of its files' sizes")
        return manifest

    def verify(self, step: int) -> Manifest:
        """Check every file of `step` against its manifest, in place. `IntegrityError` names the
        first bad file (missing, wrong size, or wrong sha256)."""
        manifest = self.check_listing(step)

        def check(entry: FileEntry) -> None:
            size, sha = self._hash_stored(self.step_key(step, entry.path), entry.size)
            self._check(step, entry, size, sha)

        self.store.map_parallel(check, manifest.files)
        return manifest

    def _check(self, step: int, entry: FileEntry, size: int, sha: str | None) -> None:
        url = self.step_url(step, entry.path)
        if size != entry.size:
            raise IntegrityError(f"{url} has {size} bytes, the manifest says {entry.size}")
        if sha is not None and sha != entry.sha256:
            raise IntegrityError(f"{url} is corrupt: sha256 {sha[:16]}…, the manifest says {entry.sha256[:16]}…")

    def fetch(self, step: int, local_dir: str) -> Manifest:
        """Download `step` into `local_dir`, verifying every file on the way: each is hashed as
        its bytes arrive (parallel per file), so verification costs no second pass."""
        manifest = self.check_listing(step)

        def get(entry: FileEntry) -> None:
            key, path = self.step_key(step, entry.path), os.path.join(local_dir, *entry.path.split("/"))
            try:
                size, sha = self.store.get_file_hashed(key, path, checksum=False)  # sha256 is in MANIFEST
            except ObjectNotFound:
                raise IntegrityError(f"{self.step_url(step, entry.path)} is missing (listed in the manifest)") from None
            try:
                self._check(step, entry, size, sha)
            except IntegrityError:
                os.unlink(path)  # never leave a bad copy where a loader could find it
                raise

        self.store.map_parallel(get, manifest.files)
        return manifest

    def check_listing(self, step: int) -> Manifest:
        """The manifest of `step`, with every file it lists present at its size and no file it does not
        list (a listing: nothing is read). The contents are verified by whoever reads them (`restore`)."""
        manifest = self.read_manifest(step)
        sizes = {_rel(o, self.step_key(step)): o.size for o in self.store.list(self.step_key(step))}
        for entry in manifest.files:
            if entry.path not in sizes:
                raise IntegrityError(f"{self.step_url(step, entry.path)} is missing (listed in the manifest)")
            self._check(step, entry, sizes[entry.path], None)
        listed = {entry.path for entry in manifest.files}
        # Besides the manifest, only the writers' hash records may be left (a crash between the commit and
        # their removal); nothing reads them once the step is committed.
        extra = sorted(rel for rel in sizes if rel not in listed and rel != layout.MANIFEST
                       and not rel.startswith(f"{HASH_DIR}/"))
        if extra:
            raise IntegrityError(f"{self.step_url(step, extra[0])} is not in the manifest (a committed step holds "
                                 "only the files its manifest lists)")
        return manifest

    def restore(self, load: Callable[[int, Manifest], None]) -> int | None:
        """Load the newest committed step through `load(step, manifest)`, which must verify each file
        against the manifest as it reads it and raise IntegrityError on a mismatch: every byte is read
        once. A step that fails is skipped with a warning naming the bad file, and the next older one
        is loaded. Returns the step loaded, or None (nothing committed, or nothing verifies)."""

        def attempt(step: int) -> Manifest:
            manifest = self.check_listing(step)
            load(step, manifest)
            return manifest

        found = self._first_good(attempt)
        return found[0] if found else None

    def resolve_loadable(self) -> int | None:
        """The newest committed step that verifies; warns naming the bad file for each skipped one."""
        loaded = self._first_good(lambda step: self.verify(step))
        return loaded[0] if loaded else None

    def load_latest(self, local_dir: str | None = None) -> LoadedCheckpoint | None:
        """The newest committed step that verifies, with its trainer state. With `local_dir`, the
        files are fetched there (download + verify in one pass) and `url` is the local copy;
        otherwise they are verified in place and `url` is the step's store URL. None: nothing
        committed (or nothing that verifies)."""

        def attempt(step: int) -> Manifest:
            if local_dir is None:
                return self.verify(step)
            return self.fetch(step, os.path.join(local_dir, layout.step_dir(step)))

        found = self._first_good(attempt)
        if found is None:
            return None
        step, manifest = found
        url = self.step_url(step) if local_dir is None else os.path.join(local_dir, layout.step_dir(step))
        return LoadedCheckpoint(step=step, url=url, manifest=manifest, trainer_state=self.read_trainer_state(step))

    def _first_good(self, attempt: Callable[[int], Manifest]) -> tuple[int, Manifest] | None:
        steps = self.committed_steps()
        for i, step in enumerate(reversed(steps)):
            try:
                return step, attempt(step)
            except IntegrityError as err:
                older = steps[-i - 2] if i + 1 < len(steps) else None
                then = f"falling back to step {older}" if older is not None else "no older committed checkpoint"
                message = f"checkpoint step {step} of run {self.run_id!r} failed verification: {err}; {then}"
                log.warning("%s", message)
                warnings.warn(message, CheckpointFallbackWarning, stacklevel=3)
        return None

    # ------------------------------------------------------------ retention

    def apply_retention(self, latest: int | None = None) -> list[int]:
        """Delete committed steps beyond the last `keep_last` (keeping every `keep_every`-th),
        never the newest one or the one LATEST names (`latest`, when the caller just wrote it);
        also abandoned uncommitted folders older than the newest committed step. Returns the
        deleted committed steps."""
        by_step: dict[int, list[str]] = {}
        for o in self.store.list(self._dir_key()):
            step = layout.parse_step_dir(_rel(o, self._dir_key()).split("/", 1)[0])
            if step is not None:
                by_step.setdefault(step, []).append(o.key)
        committed = sorted(s for s, keys in by_step.items() if self.step_key(s, layout.MANIFEST) in keys)
        if not committed:
            return []
        keep = set(committed[-self.keep_last:]) | {committed[-1]}
        if self.keep_every:
            keep |= {s for s in committed if s % self.keep_every == 0}
        pointer = latest if latest is not None else self.latest_pointer()
        if pointer is not None:
            keep.add(pointer)
        doomed = [s for s in committed if s not in keep]
        for step in doomed:
            # Un-commit first: a crash mid-delete leaves an ignored folder, never a partial "committed" one.
            manifest = self.step_key(step, layout.MANIFEST)
            self.store.delete(manifest)
            self.store.delete_many([k for k in by_step[step] if k != manifest])
        abandoned = [s for s in by_step if s not in committed and s < committed[-1]]
        self.store.delete_many([k for s in abandoned for k in by_step[s]])
        if doomed:
            log.info("retention removed checkpoint steps %s of run %s", doomed, self.run_id)
        return doomed


def _rel(obj: ObjectInfo, prefix: str) -> str:
    return obj.key[len(prefix) + 1:]
