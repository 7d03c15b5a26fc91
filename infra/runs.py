"""The run layout in storage, the writer lease, metrics, and what `rlflow runs` shows.

    <root>/<run_id>/
      run.json                          config snapshot (secrets stripped by the caller), lineage
      lock.json                         writer lease
      metrics/iter_000007.json          one object per finished iteration (see below)
      buffers/iter_000007/<name>.parquet (+ <name>.ref.json)       infra.buffers
      checkpoints/step_000007/... MANIFEST.json, checkpoints/LATEST   infra.checkpoints
      export/step_000020/               Hugging Face format

Metrics: S3 has no append, and rewriting one metrics.jsonl per iteration is a read-modify-write
that grows with the run and loses a line to any concurrent or interrupted rewrite. So each finished
iteration is its own small object, `metrics/iter_NNNNNN.json` (one JSON object, written atomically,
idempotent when an iteration is redone); `read_metrics()` merges them in iteration order, and
`metrics_jsonl()` gives the merged text: the metrics.jsonl view (docs/architecture.md).

The lease (`lock.json`) makes a second writer of the same run fail instead of interleaving:
- acquire: conditional create (S3 `If-None-Match: *`, locally link(2)); if it exists and is held
  and unexpired, `LeaseError` naming the holder (host, pid, since, expiry).
- takeover of an expired or released lease: conditional replace on the version read (S3
  `If-Match: <ETag>`, locally compare-and-swap under flock). Two takers race on the same version:
  exactly one replace succeeds, the other re-reads and is refused.
- renew / release: conditional replace on the version this holder last wrote; failing means the
  lease was taken over (it had expired), and `LeaseError` says by whom.
Every write carries the holder's random token and a generation counter, so a retried request whose
first try did land is recognised as ours. Expiry compares wall clocks: hosts need NTP-level sync.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from infra import layout
from infra.errors import CorruptRecordError, LeaseError, ObjectNotFound, StoreError
from infra.record_key import existing_record_key, record_key, sign, verify
from infra.records import LeaseRecord, RunInfoRecord, check_record, parse_metrics, parse_record
from infra.store import ObjectInfo, ObjectStore

if TYPE_CHECKING:
    from infra.checkpoints import CheckpointStore

log = logging.getLogger("rlflow.storage")

# Keys that must never reach run.json, whatever the caller forgot to strip.
_SECRET_KEY = re.compile(r"secret|password|passwd|access_key|private_key|session_token|api_key|credential",
                         re.IGNORECASE)


def _now_iso(ts: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if ts is None else ts, tz=timezone.utc).isoformat(
        timespec="seconds")


def find_secret_keys(value: Any, path: str = "") -> list[str]:
    """Dotted paths of every dict key in `value` that is named like a credential."""
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if _SECRET_KEY.search(str(k)):
                found.append(where)
            found += find_secret_keys(v, where)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found += find_secret_keys(v, f"{path}[{i}]")
    return found


# ========================================================================= lease


@dataclass
class Lease:
    """The writer lease of one run, held by this process. Use `RunStore.acquire_lease()`."""

    store: ObjectStore
    run_id: str
    ttl_s: float
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    record: dict[str, Any] = field(default_factory=dict)
    tag: str = ""
    _renewer: threading.Thread | None = field(default=None, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _lost: LeaseError | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # renewer vs owner

    @property
    def key(self) -> str:
        return f"{self.run_id}/{layout.LOCK_JSON}"

    def _new_record(self, generation: int, released: bool = False) -> dict[str, Any]:
        now = time.time()
        since = self.record.get("since", _now_iso(now)) if self.record else _now_iso(now)
        return {
            "run_id": self.run_id, "token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
            "since": since, "renewed": _now_iso(now), "expires_at": now + self.ttl_s,
            "expires": _now_iso(now + self.ttl_s), "generation": generation, "released": released,
        }  # fmt: skip

    def acquire(self) -> Lease:
        """Take the lease: create it, or take over an expired/released one. `LeaseError` if held."""
        for _ in range(10):
            mine = self._new_record(generation=1)
            if self.store.put_if_absent(self.key, _dump(mine)):
                if self._confirm(mine):
                    return self
                continue
            try:
                data, tag = self.store.get_versioned(self.key)
            except ObjectNotFound:
                continue  # released and deleted in between: try to create again
            current = _parse_lease(data, self.store.url(self.key))
            if current.get("token") == self.token:  # our create landed; the retry saw it
                self.record, self.tag = current, tag
                return self
            live = not current.get("released") and float(current.get("expires_at", 0)) > time.time()
            if live and not _holder_is_dead(current):
                raise LeaseError(f"run {self.run_id!r} already has a writer: {describe_holder(current)}; "
                                 f"wait for it to finish or for the lease to expire ({self.store.url(self.key)})")
            mine = self._new_record(generation=int(current.get("generation", 0)) + 1)
            if self.store.put_if_match(self.key, _dump(mine), tag) and self._confirm(mine):
                why = "released" if current.get("released") else "expired" if not live else "dead holder's"
                log.info("took over the %s lease of run %s from %s", why, self.run_id, describe_holder(current))
                return self
            # Another writer replaced it first: loop, read theirs, and be refused.
        raise LeaseError(f"could not take the lease of run {self.run_id!r}: it keeps changing "
                         f"({self.store.url(self.key)})")

    def _confirm(self, written: dict[str, Any]) -> bool:
        """Read back what we wrote: the version tag for the next CAS, and proof it is ours."""
        try:
            data, tag = self.store.get_versioned(self.key)
        except ObjectNotFound:
            return False
        current = _parse_lease(data, self.store.url(self.key))
        if current.get("token") != self.token or current.get("generation") != written["generation"]:
            return False
        self.record, self.tag = current, tag
        return True

    def _replace(self, released: bool) -> None:
        with self._lock:
            self._replace_locked(released)

    def _replace_locked(self, released: bool) -> None:
        new = self._new_record(int(self.record.get("generation", 0)) + 1, released=released)
        if self.store.put_if_match(self.key, _dump(new), self.tag) and self._confirm(new):
            return
        if self._confirm(new):  # a retried write whose first try landed
            return
        try:
            holder = describe_holder(_parse_lease(self.store.get_bytes(self.key), self.store.url(self.key)))
        except ObjectNotFound:
            holder = "nobody (the lease was deleted)"
        raise LeaseError(f"lost the lease of run {self.run_id!r}: it expired and was taken over by {holder}")

    def renew(self) -> None:
        """Push the expiry `ttl_s` into the future. `LeaseError` if the lease was taken over."""
        if self._lost is not None:
            raise self._lost
        self._replace(released=False)

    def release(self) -> None:
        """Give the lease up (the next writer takes it at once). No error if it was taken over."""
        self.stop_renewing()
        if self.record.get("released"):
            return
        try:
            self._replace(released=True)
        except LeaseError as err:
            log.warning("%s", err)

    def start_renewing(self, every_s: float | None = None) -> None:
        """Renew from a daemon thread every `every_s` (default ttl/3). A failed renewal is kept and
        raised by the next `check()` / `renew()`."""
        interval = every_s if every_s is not None else self.ttl_s / 3

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self._replace(released=False)
                except Exception as err:  # noqa: BLE001 - handed to the owner through check()
                    self._lost = err if isinstance(err, LeaseError) else LeaseError(
                        f"could not renew the lease of run {self.run_id!r}: {err}")
                    return

        self._stop.clear()
        self._renewer = threading.Thread(target=loop, name=f"lease-{self.run_id}", daemon=True)
        self._renewer.start()

    def stop_renewing(self) -> None:
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join()
        self._renewer = None

    def check(self) -> None:
        """Raise `LeaseError` if background renewal failed (the lease may belong to another writer)."""
        if self._lost is not None:
            raise self._lost

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder_is_dead(record: dict[str, Any]) -> bool:
    """A holder on this host whose process is gone (a crashed or killed writer): its lease is void.
    A holder on another host is only ever judged by its expiry."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    if record["pid"] == os.getpid():
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _dump(record: dict[str, Any]) -> bytes:
    return json.dumps(record, indent=1, sort_keys=True).encode()


def _parse_lease(data: bytes, url: str) -> dict[str, Any]:
    """lock.json, parsed totally (infra.records.LeaseRecord)."""
    try:
        return parse_record(LeaseRecord, data, url, "lease").model_dump()
    except CorruptRecordError as err:
        raise CorruptRecordError(f"{err}; if no writer is running, delete it") from None


def describe_holder(record: dict[str, Any]) -> str:
    """`host gpu-3 pid 4242 since 2026-01-01T10:00:00+00:00 (expires ...)` of a lease record."""
    state = "released" if record.get("released") else f"expires {record.get('expires', '?')}"
    return (f"host {record.get('host', '?')} pid {record.get('pid', '?')} since "
            f"{record.get('since', '?')} ({state})")


# ===================================================================== the run


@dataclass(frozen=True)
class BufferInfo:
    iteration: int
    name: str
    key: str
    size: int


@dataclass
class RunSummary:
    """What `rlflow runs show` prints; built from one listing of the run's folder."""

    run_id: str
    url: str
    created: str | None
    iterations_done: int
    last_iteration: int | None
    latest_checkpoint: int | None
    checkpoints: list[int]
    uncommitted_checkpoints: list[int]
    buffers: list[BufferInfo]
    exports: list[int]
    bytes_total: int
    lease: str | None


class RunStore:
    """One run's folder in the store: run.json, the lease, metrics, buffer and export paths."""

    def __init__(self, store: ObjectStore, run_id: str) -> None:
        self.store = store
        self.run_id = layout.check_run_id(run_id)

    def __repr__(self) -> str:
        return f"RunStore({self.store!r}, {self.run_id!r})"

    def key(self, *parts: str) -> str:
        return "/".join((self.run_id, *parts))

    def url(self, *parts: str) -> str:
        return self.store.url(self.key(*parts))

    def exists(self) -> bool:
        return self.store.exists(self.key(layout.RUN_JSON))

    # ------------------------------------------------------------- run.json

    def write_run_info(self, config: dict[str, Any], *, code_version: str | None = None,
                       parent: dict[str, Any] | None = None, **extra: Any) -> None:
        """Write run.json: the public config snapshot, code version and lineage (`parent`: the run
        and checkpoint this one starts from). Refuses any key named like a credential."""
        info = {"run_id": self.run_id, "created": _now_iso(), "config": config,
                "code_version": code_version, "parent": parent, **extra}
        try:
            info["created"] = self.read_run_info().get("created", info["created"])
        except ObjectNotFound:
            pass
        leaked = find_secret_keys(info)
        if leaked:
            raise StoreError(f"refusing to write {self.url(layout.RUN_JSON)}: keys {leaked} look like "
                             "credentials (pass the config's public_dict())")
        info = sign(info, self.run_id, record_key())  # what a resume may take from it: infra/record_key.py
        self.store.put_bytes(self.key(layout.RUN_JSON), json.dumps(info, indent=2, sort_keys=False).encode())

    def read_signed_run_info(self) -> tuple[dict[str, Any], str | None]:
        """run.json (parsed totally, as read_run_info) and None when it is signed for this run with this
        user's record key; else why not (the record then decides nothing: flows/plan.py)."""
        info = self.read_run_info()
        return info, verify(info, self.run_id, existing_record_key())

    def read_run_info(self) -> dict[str, Any]:
        """run.json, parsed totally (infra.records.RunInfoRecord): CorruptRecordError naming it otherwise."""
        return check_record(RunInfoRecord, self.store.get_bytes(self.key(layout.RUN_JSON)), self.url(layout.RUN_JSON),
                            "run.json")

    # ---------------------------------------------------------------- lease

    def acquire_lease(self, ttl_s: float = 300.0) -> Lease:
        """Become the run's only writer for `ttl_s` (renew it, or `start_renewing()`)."""
        return Lease(self.store, self.run_id, ttl_s).acquire()

    def lease_holder(self) -> dict[str, Any] | None:
        """The current lease record, or None when nobody ever held it."""
        try:
            return _parse_lease(self.store.get_bytes(self.key(layout.LOCK_JSON)), self.url(layout.LOCK_JSON))
        except ObjectNotFound:
            return None

    # -------------------------------------------------------------- metrics

    def write_metrics(self, iteration: int, metrics: dict[str, Any]) -> None:
        """Record iteration `iteration` as finished with its metrics (idempotent)."""
        record = {"iteration": iteration, **metrics}
        key = self.key(layout.METRICS_DIR, layout.iter_dir(iteration) + ".json")
        self.store.put_bytes(key, json.dumps(record, sort_keys=True).encode())

    def finished_iterations(self) -> list[int]:
        found = (layout.parse_metrics_file(o.key.rsplit("/", 1)[-1])
                 for o in self.store.list(self.key(layout.METRICS_DIR)))
        return sorted(i for i in found if i is not None)

    def last_finished_iteration(self) -> int | None:
        done = self.finished_iterations()
        return done[-1] if done else None

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every finished iteration's metrics, in iteration order."""
        done = self.finished_iterations()
        keys = [self.key(layout.METRICS_DIR, layout.iter_dir(i) + ".json") for i in done]
        return [parse_metrics(data, self.store.url(key), i)
                for i, key, data in zip(done, keys, self.store.map_parallel(self.store.get_bytes, keys))]

    def metrics_jsonl(self) -> str:
        """The merged metrics.jsonl view: one line per finished iteration."""
        return "".join(json.dumps(m, sort_keys=True) + "\n" for m in self.read_metrics())

    # -------------------------------------------------------- buffers, export

    def buffer_key(self, iteration: int, name: str) -> str:
        return self.key(layout.BUFFERS_DIR, layout.iter_dir(iteration), layout.check_buffer_name(name) + ".parquet")

    def buffers(self) -> list[BufferInfo]:
        return _buffers(self.store.list(self.key(layout.BUFFERS_DIR)))

    def export_key(self, step: int) -> str:
        return self.key(layout.EXPORT_DIR, layout.step_dir(step))

    def export_url(self, step: int) -> str:
        """Where the Hugging Face export of `step` goes (a folder URL for save_pretrained / put_dir)."""
        return self.store.url(self.export_key(step))

    def checkpoints(self, keep_last: int = 3, keep_every: int = 0) -> CheckpointStore:
        from infra.checkpoints import CheckpointStore

        return CheckpointStore(self.store, self.run_id, keep_last=keep_last, keep_every=keep_every)

    # -------------------------------------------------------------- summary

    def summary(self) -> RunSummary:
        objects = self.store.list(self.run_id)
        rel = [(o.key[len(self.run_id) + 1:].split("/"), o) for o in objects]
        metrics = sorted(i for parts, _ in rel if len(parts) == 2 and parts[0] == layout.METRICS_DIR
                         and (i := layout.parse_metrics_file(parts[1])) is not None)
        steps: dict[int, bool] = {}
        exports: set[int] = set()
        for parts, _ in rel:
            if len(parts) >= 3 and parts[0] == layout.CHECKPOINTS_DIR:
                step = layout.parse_step_dir(parts[1])
                if step is not None:
                    steps[step] = steps.get(step, False) or parts[2:] == [layout.MANIFEST]
            if len(parts) >= 2 and parts[0] == layout.EXPORT_DIR:
                step = layout.parse_step_dir(parts[1])
                if step is not None:
                    exports.add(step)
        committed = sorted(s for s, ok in steps.items() if ok)
        created = None
        if any(parts == [layout.RUN_JSON] for parts, _ in rel):
            created = self.read_run_info().get("created")
        holder = self.lease_holder()
        return RunSummary(
            run_id=self.run_id, url=self.url(), created=created, iterations_done=len(metrics),
            last_iteration=metrics[-1] if metrics else None,
            latest_checkpoint=committed[-1] if committed else None, checkpoints=committed,
            uncommitted_checkpoints=sorted(s for s, ok in steps.items() if not ok),
            buffers=_buffers(o for parts, o in rel if parts[0] == layout.BUFFERS_DIR),
            exports=sorted(exports), bytes_total=sum(o.size for o in objects),
            lease=describe_holder(holder) if holder else None,
        )  # fmt: skip


def _buffers(objects: Iterable[ObjectInfo]) -> list[BufferInfo]:
    out = []
    for o in objects:
        parts = o.key.split("/")
        if len(parts) >= 2 and parts[-1].endswith(".parquet"):
            iteration = layout.parse_iter_dir(parts[-2])
            if iteration is not None:
                out.append(BufferInfo(iteration, parts[-1].removesuffix(".parquet"), o.key, o.size))
    return sorted(out, key=lambda b: (b.iteration, b.name))


def list_runs(store: ObjectStore) -> list[str]:
    """Run ids under the root: folders that hold a run.json."""
    names = [n for n in store.list_dirs("") if not n.startswith(".")]
    flags: list[bool] = store.map_parallel(lambda n: store.exists(f"{n}/{layout.RUN_JSON}"), names)
    return [n for n, ok in zip(names, flags) if ok]
