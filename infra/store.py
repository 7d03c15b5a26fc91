"""`ObjectStore`: one storage root — a local folder or `s3://bucket/prefix` — with retries.

    store = ObjectStore.from_config(cfg.storage)           # or ObjectStore("s3://rlflow/runs")
    store.put_bytes("run1/run.json", b"{}")
    store.get_bytes("run1/run.json")

Keys are POSIX paths relative to the root ("run1/buffers/iter_000007/rollout.parquet");
`store.url(key)` is the full fsspec URL (a local absolute path, or s3://...) that pandas, pyarrow and
torch.distributed.checkpoint open directly.

What the store guarantees on both backends:
- A reader never sees a partial object: S3 PUTs are atomic; local writes go to a temp file in the
  same folder and are renamed over the target (`os.replace`).
- `put_if_absent` is a real conditional create: S3 `If-None-Match: *` (s3fs `mode="create"`), locally
  a hard link of the finished temp file, which fails if the name exists.
- `put_if_match` is a compare-and-swap on a version tag from `get_versioned`: S3 `If-Match: <ETag>`,
  locally the sha256 of the content, compared and replaced under an exclusive `flock`.
- Transient failures (refused or reset connections, timeouts, 5xx, throttling) are retried with
  exponential backoff and jitter, `retry_attempts` tries, waits capped at `retry_max_wait_s`.
  botocore's and s3fs's own retries are switched off for these calls so the bound is ours, and the
  connect/read timeouts turn a hung server into a retry instead of a hang. Permanent failures (403,
  no such bucket, a missing object) raise at once as `StoreError` / `ObjectNotFound`, naming the object.
- `checksum=False` on a transfer skips botocore's per-request CRC (computed on both ends of every
  PUT and GET); callers use it only for data whose sha256 they record and verify end to end
  (checkpoint files, see infra.checkpoints).

Credentials come from `StorageConfig` or the standard AWS environment variables (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_DEFAULT_REGION), else botocore's
default chain. They are never logged, never in `repr`, and never pickled: a store sent to another
process (a Ray task) carries the root, endpoint and settings, and takes credentials from that
process's environment.
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import hashlib
import logging
import os
import random
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, TypeVar, cast

from infra.config import StorageConfig
from infra.errors import ObjectNotFound, StoreError, StoreUnavailable

log = logging.getLogger("rlflow.storage")

T = TypeVar("T")

# Local temp files and CAS lock files carry this prefix; listings never show them.
_HIDDEN_PREFIX = ".rlflow-"
# scheme://user:password@host: the userinfo (the URL's authority ends at the first /, ? or #; in a repr, at a
# quote or a space)
URL_USERINFO = re.compile(r"(?<=://)[^/?#\s'\"]*@")
_CHUNK = 8 * 2**20

# S3 error codes that mean "try again later". Everything else from the server is permanent.
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
    "RequestTimeout", "InternalError", "ServiceUnavailable", "XAmzContentSHA256Mismatch",
    "500", "502", "503", "504",
}  # fmt: skip
_DENIED_CODES = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
    "AllAccessDisabled", "AccountProblem", "403",
}  # fmt: skip


def mask_url_credentials(text: str) -> str:
    """`text` with the credentials of every URL in it (user:password@) shown as ***@."""
    return URL_USERINFO.sub("***@", text)


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class ObjectStore:
    """A storage root with put/get/list/delete, conditional writes and bounded retries.

    Args:
        root: a folder path (`./runs`, `/data/runs`, `file:///data/runs`) or `s3://bucket/prefix`.
        endpoint_url, region, access_key_id, secret_access_key: S3 settings; default: environment.
        retry_attempts: tries for a transient failure; retry_max_wait_s: cap of one backoff wait.
        connect_timeout_s, read_timeout_s: S3 socket timeouts (a hung server becomes a retry).
        max_concurrency: threads of `map_parallel` (`put_dir`, `get_dir`, checkpoint shards).
    """

    def __init__(
        self,
        root: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        retry_attempts: int = 8,
        retry_max_wait_s: float = 8.0,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        max_concurrency: int = 8,
    ) -> None:
        self.retry_attempts = retry_attempts
        self.retry_max_wait_s = retry_max_wait_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_concurrency = max_concurrency
        self._backend: _Backend
        if root.startswith("s3://") or root.startswith("s3a://"):
            self.protocol = "s3"
            self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
                "AWS_ENDPOINT_URL"
            )
            self.region = region or os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
            self.root = "s3://" + root.split("://", 1)[1].strip("/")
            self._backend = _S3Backend(self, access_key_id, secret_access_key)
        elif "://" in root and not root.startswith("file://"):
            raise StoreError(f"storage root {root!r}: only local folders and s3:// URLs are supported")
        else:
            self.protocol = "file"
            self.endpoint_url = None
            self.region = None
            self.root = os.path.abspath(os.path.expanduser(root.removeprefix("file://")))
            self._backend = _LocalBackend()

    @classmethod
    def from_config(cls, cfg: StorageConfig, root: str | None = None) -> ObjectStore:
        """The store of `cfg.storage` (or of `root`, overriding cfg.root)."""
        return cls(
            root or cfg.root,
            endpoint_url=cfg.endpoint_url,
            region=cfg.region,
            access_key_id=cfg.access_key_id.get_secret_value() if cfg.access_key_id else None,
            secret_access_key=cfg.secret_access_key.get_secret_value() if cfg.secret_access_key else None,
            retry_attempts=cfg.retry_attempts,
            retry_max_wait_s=cfg.retry_max_wait_s,
            connect_timeout_s=cfg.connect_timeout_s,
            read_timeout_s=cfg.read_timeout_s,
            max_concurrency=cfg.max_concurrency,
        )

    @property
    def endpoint_shown(self) -> str | None:
        """endpoint_url for messages, credentials in it (user:password@, from AWS_ENDPOINT_URL) masked."""
        return None if self.endpoint_url is None else mask_url_credentials(self.endpoint_url)

    # Credentials stay out of repr and pickles (see the module docstring).
    def __repr__(self) -> str:
        where = f", endpoint={self.endpoint_shown!r}" if self.endpoint_url else ""
        return f"ObjectStore({self.root!r}{where})"

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = dict(
            endpoint_url=self.endpoint_url, region=self.region, retry_attempts=self.retry_attempts,
            retry_max_wait_s=self.retry_max_wait_s, connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s, max_concurrency=self.max_concurrency,
        )  # fmt: skip
        return (_rebuild_store, (self.root, kwargs))

    # ------------------------------------------------------------------ paths

    def url(self, key: str = "") -> str:
        """The full fsspec URL of `key`: an absolute local path, or s3://bucket/prefix/key."""
        key = _clean_key(key)
        if self.protocol == "file":
            return os.path.join(self.root, *key.split("/")) if key else self.root
        return f"{self.root}/{key}" if key else self.root

    def key_of(self, url: str) -> str:
        """The key of a URL under this root (inverse of `url`)."""
        root = self.root.rstrip("/") + "/"
        if self.protocol == "file":
            url = os.path.abspath(url.removeprefix("file://"))
            root = os.path.join(self.root, "")
        if not url.startswith(root):
            raise StoreError(f"{url!r} is not under the storage root {self.root!r}")
        return url[len(root):].replace(os.sep, "/")

    def _path(self, key: str) -> str:
        """The backend path of `key` (s3: bucket/prefix/key without the scheme). Locally, no folder or file
        below the root may be a link: whoever can write the root could otherwise send a write (or a read)
        anywhere this user can reach (a link named `metrics` or `export`). The root itself is the user's."""
        url = self.url(key)
        if self.protocol == "s3":
            return url.split("://", 1)[1]
        current = self.root
        for part in _clean_key(key).split("/") if key else []:
            current = os.path.join(current, part)
            try:
                mode = os.lstat(current).st_mode
            except FileNotFoundError:
                break  # the rest is made by the write, as folders
            except NotADirectoryError:
                break
            if stat.S_ISLNK(mode):
                raise StoreError(f"{current} is a link inside the storage root {self.root}: rlflow does not "
                                 "follow links there (a write through it would land outside the root); remove it")
        return url

    def storage_options(self) -> dict[str, Any]:
        """fsspec keyword arguments that open this root (for torch.distributed.checkpoint's
        FsspecWriter/Reader). Holds credentials: pass it on in-process, never log or persist it."""
        return self._backend.storage_options()

    # ---------------------------------------------------------------- retries

    def _retry(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run `fn`, retrying transient failures with exponential backoff and jitter."""
        start = time.monotonic()
        for attempt in range(1, self.retry_attempts + 1):
            try:
                return fn()
            except Exception as err:  # noqa: BLE001 - classified below
                kind = classify_error(err)
                if kind != "transient":
                    raise self._permanent_error(what, key, err, kind) from err
                if attempt == self.retry_attempts:
                    raise StoreUnavailable(
                        f"{what} {self.url(key)} failed after {attempt} tries over "
                        f"{time.monotonic() - start:.1f}s: {_describe(err)}"
                    ) from err
                # "Equal jitter" (AWS Architecture Blog, Exponential Backoff and Jitter): half the
                # exponential step fixed, half random, so retries never all fire at once.
                step = min(self.retry_max_wait_s, 0.2 * 2 ** (attempt - 1))
                wait = step / 2 + random.uniform(0, step / 2)
                log.warning("%s %s: %s; retry %d/%d in %.1fs", what, self.url(key), _describe(err),
                            attempt, self.retry_attempts - 1, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _permanent_error(self, what: str, key: str, err: Exception, kind: str) -> Exception:
        url = self.url(key)
        if kind == "no_bucket":
            bucket = self.root.split("://", 1)[1].split("/", 1)[0]
            where = f" at {self.endpoint_shown}" if self.endpoint_url else ""
            return StoreError(f"bucket {bucket!r} does not exist{where} (storage root {self.root})")
        if kind == "denied":
            return StoreError(
                f"access denied to {url} ({_describe(err)}): check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY or storage.access_key_id / storage.secret_access_key"
            )
        if kind == "no_credentials":
            return StoreError(f"no credentials to {what} {url}: set AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY, or storage.access_key_id / storage.secret_access_key")
        if kind == "not_found":
            return ObjectNotFound(f"{url} does not exist")
        if isinstance(err, StoreError):
            return err
        return StoreError(f"{what} {url} failed: {_describe(err)}")

    # ------------------------------------------------------------- operations

    def put_bytes(self, key: str, data: bytes, *, checksum: bool = True) -> None:
        """Write `data` to `key`, replacing it atomically. `checksum=False` skips the transport's
        per-request checksum (S3 CRC) for data whose sha256 the caller records and verifies."""
        self._retry("write", key, lambda: self._backend.put_bytes(self._path(key), data, checksum))

    def get_bytes(self, key: str, *, checksum: bool = True) -> bytes:
        """The content of `key`; `ObjectNotFound` when absent."""
        return self._retry("read", key, lambda: self._backend.get_bytes(self._path(key), checksum))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` with `data` unless it exists. True when this call created it.

        After a retried request whose first try did land, this returns False: callers that must
        know put something unique in `data` (the writer lease puts its owner token) and read back.
        """
        return self._retry("create", key, lambda: self._backend.put_if_absent(self._path(key), data))

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The content of `key` and a version tag for `put_if_match`."""
        return self._retry("read", key, lambda: self._backend.get_versioned(self._path(key)))

    def put_if_match(self, key: str, data: bytes, tag: str) -> bool:
        """Replace `key` with `data` only if its version is still `tag`. True when replaced;
        False when another writer changed (or deleted) it first."""
        return self._retry("replace", key, lambda: self._backend.put_if_match(self._path(key), data, tag))

    def exists(self, key: str) -> bool:
        return self._retry("check", key, lambda: self._backend.exists(self._path(key)))

    def size(self, key: str) -> int:
        """Bytes of `key`; `ObjectNotFound` when absent."""
        return self._retry("stat", key, lambda: self._backend.size(self._path(key)))

    def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        """Every object under `prefix` (recursive), sorted by key; [] when there is none."""
        base = self._path(prefix)
        found = self._retry("list", prefix, lambda: self._backend.find(base))
        root = self._path("")
        return sorted(
            (ObjectInfo(_relative(path, root), size) for path, size in found.items()),
            key=lambda o: o.key,
        )

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        """The names of the immediate sub-folders of `prefix` (one level, not recursive)."""
        return sorted(self._retry("list", prefix, lambda: self._backend.list_dirs(self._path(prefix))))

    def delete(self, key: str) -> None:
        """Delete `key`; no error when it does not exist."""
        self._retry("delete", key, lambda: self._backend.delete(self._path(key)))

    def delete_many(self, keys: builtins.list[str]) -> None:
        """Delete `keys` (S3: batched DeleteObjects requests); missing ones are no error."""
        if keys:
            paths = [self._path(k) for k in keys]
            self._retry("delete", keys[0], lambda: self._backend.delete_many(paths))

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under `prefix` (a folder)."""
        if not _clean_key(prefix):
            raise StoreError("refusing to delete the whole storage root")
        self._retry("delete", prefix, lambda: self._backend.delete_prefix(self._path(prefix)))

    @contextmanager
    def open(self, key: str, mode: str = "rb") -> Iterator[IO[bytes]]:
        """A streaming file object ("rb" or "wb"). A "wb" object appears only when the file closes
        without error (local: temp + rename; S3: the upload completes at close)."""
        if mode not in ("rb", "wb"):
            raise ValueError(f"open mode must be 'rb' or 'wb', got {mode!r}")
        stream = self._retry("open", key, lambda: self._backend.open(self._path(key), mode))
        try:
            yield stream
        except BaseException:
            _discard(stream)
            raise
        self._retry("write" if mode == "wb" else "read", key, stream.close)

    def put_file(self, local_path: str, key: str, *, checksum: bool = True) -> None:
        """Upload one local file to `key` (atomic, like `put_bytes`)."""
        self._retry("upload", key, lambda: self._backend.put_file(local_path, self._path(key), checksum))

    def get_file(self, key: str, local_path: str, *, checksum: bool = True) -> None:
        """Download `key` to `local_path` (written to a temp name, then renamed)."""
        os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
        self._retry("download", key, lambda: self._backend.get_file(self._path(key), local_path, checksum))

    def get_file_hashed(self, key: str, local_path: str, *, checksum: bool = True) -> tuple[int, str]:
        """Download `key` to `local_path` and return its (size, sha256), hashed as the bytes arrive
        (one pass, the hashing overlapped with the transfer)."""
        os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
        return self._retry("download", key,
                           lambda: self._backend.get_file_hashed(self._path(key), local_path, checksum))

    def put_dir(self, local_dir: str, prefix: str) -> builtins.list[str]:
        """Upload every file under `local_dir` to `prefix/<relative path>`, in parallel. Returns keys."""
        pairs = [(os.path.join(local_dir, rel), f"{_clean_key(prefix)}/{rel}") for rel in _walk(local_dir)]
        self.map_parallel(lambda pair: self.put_file(*pair), pairs)
        return [key for _, key in pairs]

    def get_dir(self, prefix: str, local_dir: str) -> builtins.list[str]:
        """Download every object under `prefix` into `local_dir`, in parallel. Returns local paths."""
        base = _clean_key(prefix)
        pairs = [(o.key, os.path.join(local_dir, *o.key[len(base) + 1:].split("/")))
                 for o in self.list(base)]  # fmt: skip
        self.map_parallel(lambda pair: self.get_file(*pair), pairs)
        return [path for _, path in pairs]

    def map_parallel(self, fn: Callable[[Any], T], items: builtins.list[Any]) -> builtins.list[T]:
        """`fn` over `items` on up to `max_concurrency` threads, results in order; the first
        failure is raised once the others have finished."""
        if len(items) <= 1 or self.max_concurrency == 1:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(min(self.max_concurrency, len(items))) as pool:
            futures = [pool.submit(fn, item) for item in items]
            return [f.result() for f in futures]

    def du(self, prefix: str = "") -> int:
        """Total bytes under `prefix`."""
        return sum(o.size for o in self.list(prefix))


def _rebuild_store(root: str, kwargs: dict[str, Any]) -> ObjectStore:
    return ObjectStore(root, **kwargs)


# ======================================================================== errors


def classify_error(err: BaseException) -> str:
    """One of: transient, not_found, no_bucket, denied, no_credentials, exists, permanent."""
    code, status = _s3_error_code(err)
    if code is not None:
        if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
            return "transient"
        if code == "NoSuchBucket":
            return "no_bucket"
        if code in _DENIED_CODES:
            return "denied"
        if code in ("NoSuchKey", "404"):
            return "not_found"
        return "permanent"
    if _is_transient_type(err):
        return "transient"
    if isinstance(err, FileExistsError):
        return "exists"
    if isinstance(err, (ObjectNotFound, FileNotFoundError)):
        return "not_found"
    if isinstance(err, PermissionError):
        return "denied"
    if type(err).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return "no_credentials"
    return "permanent"


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _s3_error_code(err: BaseException) -> tuple[str | None, int | None]:
    """The S3 error code and HTTP status of a botocore ClientError in `err`'s chain."""
    for e in _chain(err):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = response["Error"].get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return (str(code) if code is not None else None), status
    return None, None


def _is_transient_type(err: BaseException) -> bool:
    for e in _chain(err):
        if isinstance(e, (ConnectionError, TimeoutError)):  # refused, reset, broken pipe, timeouts
            return True
        names = {cls.__name__ for cls in type(e).__mro__}
        if names & {
            "HTTPClientError", "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
            "ConnectionClosedError", "IncompleteReadError", "ResponseStreamingError",
            "ResponseParserError", "FSTimeoutError", "IncompleteRead", "ClientConnectionError",
            "ClientPayloadError", "ServerDisconnectedError", "ServerTimeoutError",
        }:  # fmt: skip
            return True
        if isinstance(e, OSError) and e.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.EPIPE,
                                                   errno.ETIMEDOUT, errno.EHOSTUNREACH):
            return True
    return False


def _describe(err: BaseException) -> str:
    code, status = _s3_error_code(err)
    text = str(err).strip() or type(err).__name__
    if code is not None and code not in text:
        text = f"{code}: {text}"
    return f"{type(err).__name__}: {text}" if code is None else text


# ====================================================================== helpers


def _clean_key(key: str) -> str:
    parts = [p for p in key.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise StoreError(f"key {key!r} must not contain '..'")
    return "/".join(parts)


def _relative(path: str, root: str) -> str:
    path = path.replace(os.sep, "/")
    root = root.replace(os.sep, "/").rstrip("/") + "/"
    return path[len(root):] if path.startswith(root) else path


def _walk(local_dir: str) -> list[str]:
    """Relative POSIX paths of every file under `local_dir`, sorted."""
    out = []
    for folder, _, files in os.walk(local_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), local_dir)
            out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _discard(stream: Any) -> None:
    discard = getattr(stream, "discard", None)
    if discard is not None and getattr(stream, "mode", "wb") != "rb":
        discard()  # local: remove the temp file; S3: abort the multipart upload
        try:
            stream.closed = True  # fsspec files would otherwise try to upload at garbage collection
        except AttributeError:
            pass
    else:
        try:
            stream.close()
        except Exception:  # noqa: BLE001 - the original error is what matters
            pass


def sha256_file(path: str) -> tuple[int, str]:
    """(size, sha256 hex) of a local file, read in 8 MiB chunks (hashlib releases the GIL)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


# ===================================================================== backends


class _Backend:
    """The primitives each backend implements on backend paths; the store adds keys and retries."""

    def storage_options(self) -> dict[str, Any]:
        return {}

    def put_bytes(self, path: str, data: bytes, checksum: bool = True) -> None:
        raise NotImplementedError

    def get_bytes(self, path: str, checksum: bool = True) -> bytes:
        raise NotImplementedError

    def put_if_absent(self, path: str, data: bytes) -> bool:
        raise NotImplementedError

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        raise NotImplementedError

    def put_if_match(self, path: str, data: bytes, tag: str) -> bool:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def size(self, path: str) -> int:
        raise NotImplementedError

    def find(self, path: str) -> dict[str, int]:
        raise NotImplementedError

    def list_dirs(self, path: str) -> list[str]:
        raise NotImplementedError

    def delete(self, path: str) -> None:
        raise NotImplementedError

    def delete_many(self, paths: list[str]) -> None:
        for path in paths:
            self.delete(path)

    def delete_prefix(self, path: str) -> None:
        raise NotImplementedError

    def open(self, path: str, mode: str) -> IO[bytes]:
        raise NotImplementedError

    def put_file(self, local_path: str, path: str, checksum: bool = True) -> None:
        raise NotImplementedError

    def get_file(self, path: str, local_path: str, checksum: bool = True) -> None:
        raise NotImplementedError

    def get_file_hashed(self, path: str, local_path: str, checksum: bool = True) -> tuple[int, str]:
        raise NotImplementedError


class _LocalBackend(_Backend):
    """Plain files. Atomic replace by temp + os.replace; conditional create by link(2)."""

    def _temp(self, path: str) -> str:
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        return os.path.join(folder, f"{_HIDDEN_PREFIX}tmp-{uuid.uuid4().hex[:12]}-{name}")

    def _write_temp(self, path: str, data: bytes) -> str:
        tmp = self._temp(path)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put_bytes(self, path: str, data: bytes, checksum: bool = True) -> None:
        tmp = self._write_temp(path, data)
        os.replace(tmp, path)

    def get_bytes(self, path: str, checksum: bool = True) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def put_if_absent(self, path: str, data: bytes) -> bool:
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)  # atomic, fails with EEXIST, and `path` appears complete
            return True
        except FileExistsError:
            return False
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
        finally:
            os.unlink(tmp)
        # No hard links on this filesystem: O_EXCL is still exclusive, but a reader may see the
        # file before its bytes are written.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    @contextmanager
    def _cas_lock(self, path: str) -> Iterator[None]:
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, f"{_HIDDEN_PREFIX}lock-{name}"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        data = self.get_bytes(path)
        return data, hashlib.sha256(data).hexdigest()

    def put_if_match(self, path: str, data: bytes, tag: str) -> bool:
        with self._cas_lock(path):
            try:
                current = self.get_bytes(path)
            except FileNotFoundError:
                return False
            if hashlib.sha256(current).hexdigest() != tag:
                return False
            self.put_bytes(path, data)
            return True

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def find(self, path: str) -> dict[str, int]:
        if os.path.isfile(path):
            return {path: os.stat(path).st_size}
        out = {}
        for folder, _dirs, files in os.walk(path):
            for name in files:
                if not name.startswith(_HIDDEN_PREFIX):
                    full = os.path.join(folder, name)
                    try:
                        out[full] = os.stat(full).st_size
                    except FileNotFoundError:  # deleted while listing
                        pass
        return out

    def list_dirs(self, path: str) -> list[str]:
        try:
            return [e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith(_HIDDEN_PREFIX)]
        except FileNotFoundError:
            return []

    def delete(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def delete_prefix(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def open(self, path: str, mode: str) -> IO[bytes]:
        if mode == "rb":
            return open(path, "rb")
        return cast(IO[bytes], _AtomicLocalWriter(path, self._temp(path)))

    def put_file(self, local_path: str, path: str, checksum: bool = True) -> None:
        tmp = self._temp(path)
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, path)

    def get_file(self, path: str, local_path: str, checksum: bool = True) -> None:
        self.put_file(path, local_path)

    def get_file_hashed(self, path: str, local_path: str, checksum: bool = True) -> tuple[int, str]:
        h, size = hashlib.sha256(), 0
        tmp = self._temp(local_path)
        try:
            with open(path, "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    dst.write(chunk)
                    size += len(chunk)
            os.replace(tmp, local_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return size, h.hexdigest()


class _AtomicLocalWriter:
    """A binary file written under a temp name and renamed onto its target at `close()`."""

    def __init__(self, path: str, tmp: str) -> None:
        self.path, self.tmp = path, tmp
        self._f = open(tmp, "wb")

    def write(self, data: bytes) -> int:
        return self._f.write(data)

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self._f.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    @property
    def closed(self) -> bool:
        return self._f.closed


_session_lock = threading.Lock()
_session: Any = None


def _shared_session() -> Any:
    """One aiobotocore session per process: it caches the S3 service model, so that a new store's
    first call costs milliseconds instead of re-reading it (credentials are passed per client)."""
    global _session
    with _session_lock:
        if _session is None:
            from aiobotocore.session import AioSession

            _session = AioSession()
        return _session


_s3fs_policy_lock = threading.Lock()
_s3fs_policy_installed = False


def _install_s3fs_retry_policy() -> None:
    """s3fs's own retry loop (used by streamed files and by dcp's FsspecWriter/Reader) does not
    count refused connections as retryable; add them, once per process."""
    global _s3fs_policy_installed
    with _s3fs_policy_lock:
        if _s3fs_policy_installed:
            return
        import botocore.exceptions
        from s3fs.core import add_retryable_error

        add_retryable_error(botocore.exceptions.ConnectionError)
        _s3fs_policy_installed = True


class _S3Backend(_Backend):
    """s3fs with botocore's and s3fs's retries off (the store retries) and bounded timeouts."""

    def __init__(self, store: ObjectStore, access_key_id: str | None, secret_access_key: str | None) -> None:
        self._store = store
        self._key = access_key_id or os.environ.get("AWS_ACCESS_KEY_ID")
        self._secret = secret_access_key or os.environ.get("AWS_SECRET_ACCESS_KEY")
        self._token = os.environ.get("AWS_SESSION_TOKEN") if not access_key_id else None
        self._fs: dict[str, Any] = {}  # "managed", "unchecked", "stream": see _make_fs
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "_S3Backend()"

    def storage_options(self, retries: bool = True) -> dict[str, Any]:
        store = self._store
        options: dict[str, Any] = {
            "endpoint_url": store.endpoint_url,
            "config_kwargs": {
                "connect_timeout": store.connect_timeout_s,
                "read_timeout": store.read_timeout_s,
                "retries": {"mode": "standard", "total_max_attempts": store.retry_attempts if retries else 1},
            },
            "use_listings_cache": False,  # other ranks write under the same prefix
            "skip_instance_cache": True,
            "max_concurrency": store.max_concurrency,
        }
        if store.region:
            options["client_kwargs"] = {"region_name": store.region}
        if self._key and self._secret:
            options.update(key=self._key, secret=self._secret)
            if self._token:
                options["token"] = self._token
        return options

    def _make_fs(self, kind: str) -> Any:
        with self._lock:
            if kind not in self._fs:
                import s3fs

                _install_s3fs_retry_policy()
                options = self.storage_options(retries=kind == "stream")
                if kind == "unchecked":
                    # For objects that carry their own sha256 (checkpoint files: MANIFEST), botocore's
                    # per-request CRC (computed by client and server on every PUT and GET) is the same
                    # work done twice; the manifest check is end to end and stronger.
                    options["config_kwargs"].update(request_checksum_calculation="when_required",
                                                    response_checksum_validation="when_required")
                fs = s3fs.S3FileSystem(session=_shared_session(), **options)
                fs.retries = self._store.retry_attempts if kind == "stream" else 1
                self._fs[kind] = fs
            return self._fs[kind]

    @property
    def fs(self) -> Any:
        """The filesystem for the store's own calls: one try per call, the store retries."""
        return self._fs.get("managed") or self._make_fs("managed")

    @property
    def fs_unchecked(self) -> Any:
        """Like `fs`, without botocore's per-request checksums (see `_make_fs`)."""
        return self._fs.get("unchecked") or self._make_fs("unchecked")

    @property
    def fs_stream(self) -> Any:
        """The filesystem behind streamed files, whose reads and part uploads happen outside the
        store's calls: s3fs's and botocore's own retries stay on."""
        return self._fs.get("stream") or self._make_fs("stream")

    def put_bytes(self, path: str, data: bytes, checksum: bool = True) -> None:
        (self.fs if checksum else self.fs_unchecked).pipe_file(path, data)

    def get_bytes(self, path: str, checksum: bool = True) -> bytes:
        return bytes((self.fs if checksum else self.fs_unchecked).cat_file(path))

    def put_if_absent(self, path: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(path, data, mode="create")
            return True
        except Exception as err:
            if _is_precondition_failed(err):
                return False
            raise

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        # HEAD then GET: the content is as new as the ETag or newer, so a CAS with this tag can
        # only fail spuriously, never succeed on content we did not read.
        etag = self.fs.info(path)["ETag"]
        return bytes(self.fs.cat_file(path)), etag

    def put_if_match(self, path: str, data: bytes, tag: str) -> bool:
        try:
            self.fs.pipe_file(path, data, IfMatch=tag)
            return True
        except Exception as err:
            if _is_precondition_failed(err) or classify_error(err) == "not_found":
                return False
            raise

    def exists(self, path: str) -> bool:
        try:
            self.fs.info(path)
            return True
        except FileNotFoundError as err:
            if _s3_error_code(err)[0] == "NoSuchBucket":
                raise
            return False

    def size(self, path: str) -> int:
        return int(self.fs.info(path)["size"])

    def find(self, path: str) -> dict[str, int]:
        found = self.fs.find(path, detail=True)
        return {p: int(i["size"]) for p, i in found.items() if i.get("type") != "directory"}

    def list_dirs(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path.rstrip("/") + "/", detail=True)
        except FileNotFoundError as err:
            if _s3_error_code(err)[0] == "NoSuchBucket":
                raise
            return []
        return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"]

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError as err:
            if _s3_error_code(err)[0] == "NoSuchBucket":
                raise

    def delete_many(self, paths: list[str]) -> None:
        self.fs.rm(paths)

    def delete_prefix(self, path: str) -> None:
        keys = list(self.fs.find(path))
        if keys:
            self.fs.rm(keys)

    def open(self, path: str, mode: str) -> IO[bytes]:
        return self.fs_stream.open(path, mode)

    def put_file(self, local_path: str, path: str, checksum: bool = True) -> None:
        (self.fs if checksum else self.fs_unchecked).put_file(local_path, path)

    def get_file_hashed(self, path: str, local_path: str, checksum: bool = True) -> tuple[int, str]:
        from fsspec.asyn import sync

        fs = self.fs if checksum else self.fs_unchecked
        tmp = f"{local_path}.{_HIDDEN_PREFIX}{uuid.uuid4().hex[:8]}"
        try:
            result = sync(fs.loop, _stream_to_file, fs, path, tmp)
            os.replace(tmp, local_path)
            return result
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def get_file(self, path: str, local_path: str, checksum: bool = True) -> None:
        tmp = f"{local_path}.{_HIDDEN_PREFIX}{uuid.uuid4().hex[:8]}"
        try:
            (self.fs if checksum else self.fs_unchecked).get_file(path, tmp)
            os.replace(tmp, local_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


async def _stream_to_file(fs: Any, path: str, local_path: str) -> tuple[int, str]:
    """One GET, its body written to `local_path` and hashed chunk by chunk; the hashing and the
    file writes run on worker threads so the event loop keeps serving the other transfers.
    (s3fs's own `_get_file` streams the same way, without the hash.)"""
    import asyncio

    bucket, key, _ = fs.split_path(path)
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    body = response["Body"]
    loop = asyncio.get_running_loop()
    h, size = hashlib.sha256(), 0

    def consume(chunk: bytes) -> None:
        h.update(chunk)
        f.write(chunk)

    try:
        with open(local_path, "wb") as f:
            while chunk := await body.read(_CHUNK // 2):
                await loop.run_in_executor(None, consume, chunk)
                size += len(chunk)
    finally:
        body.close()
    return size, h.hexdigest()


def _is_precondition_failed(err: BaseException) -> bool:
    code, status = _s3_error_code(err)
    return code in ("PreconditionFailed", "412") or status == 412 or (
        isinstance(err, FileExistsError) and code is None
    )
