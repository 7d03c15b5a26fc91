"""ObjectStore on both backends: operations, atomicity, conditional writes, errors, secrets."""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import uuid

import pytest
from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_helpers import FAST

from infra.config import StorageConfig
from infra.errors import InfraError, ObjectNotFound, StoreError, StoreUnavailable
from infra.store import ObjectStore, classify_error


def test_bytes_round_trip_and_listing(store: ObjectStore) -> None:
    store.put_bytes("r/a.txt", b"hello")
    store.put_bytes("r/sub/b.bin", b"\x00" * 1000)
    assert store.get_bytes("r/a.txt") == b"hello"
    assert store.exists("r/a.txt") and not store.exists("r/zzz")
    assert store.size("r/sub/b.bin") == 1000
    assert [(o.key, o.size) for o in store.list("r")] == [("r/a.txt", 5), ("r/sub/b.bin", 1000)]
    assert store.list_dirs("") == ["r"] and store.list_dirs("r") == ["sub"]
    assert store.du("r") == 1005
    store.put_bytes("r/a.txt", b"replaced")
    assert store.get_bytes("r/a.txt") == b"replaced"
    store.delete("r/a.txt")
    store.delete("r/a.txt")  # deleting twice is fine
    assert not store.exists("r/a.txt")
    store.delete_prefix("r")
    assert store.list("r") == [] and store.list("never") == []


def test_missing_object_fails_at_once_naming_it(store: ObjectStore, caplog) -> None:
    store.put_bytes("warm", b"")  # connect first: only the failing calls are timed
    start = time.monotonic()
    with pytest.raises(ObjectNotFound, match="nothing/here"):
        store.get_bytes("nothing/here")
    with pytest.raises(FileNotFoundError):
        store.size("nothing/here")
    assert time.monotonic() - start < 3.0
    assert "retry" not in caplog.text


def test_streaming_open_write_is_invisible_until_close(store: ObjectStore) -> None:
    with store.open("s/stream.bin", "wb") as f:
        for i in range(4):
            f.write(bytes([i]) * 100_000)
        assert not store.exists("s/stream.bin")
    with store.open("s/stream.bin") as f:
        assert f.read(5) == b"\x00" * 5
        f.seek(300_000)
        assert f.read() == b"\x03" * 100_000
    with pytest.raises(RuntimeError), store.open("s/failed.bin", "wb") as f:
        f.write(b"partial")
        raise RuntimeError("writer crashed")
    assert not store.exists("s/failed.bin")


def test_files_and_directories(store: ObjectStore, tmp_path) -> None:
    src = tmp_path / "src"
    (src / "deep").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(3000))
    (src / "deep" / "b.bin").write_bytes(os.urandom(10))
    assert store.put_dir(str(src), "d") == ["d/a.bin", "d/deep/b.bin"]
    out = tmp_path / "out"
    store.get_dir("d", str(out))
    assert (out / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
    assert (out / "deep" / "b.bin").read_bytes() == (src / "deep" / "b.bin").read_bytes()
    store.get_file("d/a.bin", str(tmp_path / "single" / "x.bin"))
    assert (tmp_path / "single" / "x.bin").read_bytes() == (src / "a.bin").read_bytes()


def test_put_if_absent_has_exactly_one_winner(store: ObjectStore) -> None:
    results: list[bool] = []
    barrier = threading.Barrier(6)

    def create(i: int) -> None:
        barrier.wait()
        results.append(store.put_if_absent("c/once", f"writer {i}".encode()))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 5 + [True]
    assert store.get_bytes("c/once").startswith(b"writer ")


def test_put_if_match_is_compare_and_swap(store: ObjectStore) -> None:
    store.put_bytes("c/v", b"v1")
    _, tag = store.get_versioned("c/v")
    results: list[bool] = []
    barrier = threading.Barrier(5)

    def swap(i: int) -> None:
        barrier.wait()
        results.append(store.put_if_match("c/v", f"v2 by {i}".encode(), tag))

    threads = [threading.Thread(target=swap, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 4 + [True]
    data, new_tag = store.get_versioned("c/v")
    assert data.startswith(b"v2 by") and new_tag != tag
    assert not store.put_if_match("c/v", b"stale", tag)
    assert not store.put_if_match("c/absent", b"x", tag)


def test_readers_never_see_a_partial_object(store: ObjectStore) -> None:
    old, new = b"A" * 3_000_000, b"B" * 3_000_000
    store.put_bytes("p/obj", old)
    seen: set[bytes] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            data = store.get_bytes("p/obj")
            seen.add(data[:1] + data[-1:] + str(len(data)).encode())

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(6):
        store.put_bytes("p/obj", new if i % 2 == 0 else old)
    done.set()
    reader.join()
    assert seen <= {b"AA3000000", b"BB3000000"}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    key=st.lists(st.text("abcxyz019_-.", min_size=1, max_size=8).filter(lambda p: p not in (".", "..")),
                 min_size=1, max_size=3).map("/".join),
    data=st.binary(max_size=2000),
)
def test_any_key_and_bytes_round_trip(store: ObjectStore, key: str, data: bytes) -> None:
    # A fresh folder per example: locally "x" and "x/y" cannot both exist (S3 allows it).
    folder = f"h/{uuid.uuid4().hex[:8]}"
    store.put_bytes(f"{folder}/{key}", data)
    assert store.get_bytes(f"{folder}/{key}") == data
    assert [o.key for o in store.list(folder)] == [f"{folder}/{key}"]
    store.delete(f"{folder}/{key}")


def test_url_and_key_are_inverse(store: ObjectStore) -> None:
    url = store.url("run1/buffers/x.parquet")
    assert store.key_of(url) == "run1/buffers/x.parquet"
    with pytest.raises(StoreError, match="not under the storage root"):
        store.key_of("/elsewhere/x" if store.protocol == "file" else "s3://other/x")
    with pytest.raises(StoreError, match=r"\.\."):
        store.url("../escape")
    with pytest.raises(StoreError, match="whole storage root"):
        store.delete_prefix("")


# ------------------------------------------------------------------ permanent errors


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no_bucket", "bad_secret", "bad_key_id"])
def test_s3_permanent_errors_fail_at_once_with_a_clear_message(s3_env, case: str) -> None:
    root, kwargs = "s3://rlflow-test/x", {}
    if case == "no_bucket":
        root = "s3://no-such-bucket-here/x"
    elif case == "bad_secret":
        kwargs = {"secret_access_key": "wrong", "access_key_id": s3_env["AWS_ACCESS_KEY_ID"]}
    else:
        kwargs = {"secret_access_key": "wrong", "access_key_id": "AKIANOSUCHKEY0000000"}
    store = ObjectStore(root, retry_attempts=8, retry_max_wait_s=8.0, **kwargs)
    store._backend.fs.connect()  # type: ignore[attr-defined]  # build the client first: only calls are timed
    expected = "bucket 'no-such-bucket-here' does not exist" if case == "no_bucket" else "access denied"
    for op in (lambda: store.put_bytes("k", b"1"), lambda: store.get_bytes("k"), lambda: store.list("")):
        start = time.monotonic()
        with pytest.raises(StoreError, match=expected) as info:
            op()
        # Retried, 8 tries would wait >= 10 s in backoff alone.
        assert time.monotonic() - start < 3.0, "a permanent error must not be retried"
        assert not isinstance(info.value, StoreUnavailable)
    assert "wrong" not in str(info.value)


def test_local_permanent_error_fails_at_once(tmp_path) -> None:
    (tmp_path / "a_file").write_text("x")
    store = ObjectStore(str(tmp_path / "a_file" / "runs"), retry_attempts=8)
    start = time.monotonic()
    with pytest.raises(StoreError, match="a_file/runs/k"):
        store.put_bytes("k", b"1")
    assert time.monotonic() - start < 1.0


@pytest.mark.slow
def test_unreachable_endpoint_is_retried_then_reported(s3_env) -> None:
    store = ObjectStore("s3://rlflow-test/x", endpoint_url="http://127.0.0.1:9", retry_attempts=3,
                        retry_max_wait_s=0.2)
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"failed after 3 tries.*127\.0\.0\.1:9"):
        store.get_bytes("k")
    assert time.monotonic() - start < 3.0


@pytest.mark.slow
def test_throttling_is_retried(s3_proxy) -> None:
    # The proxy answers the first three requests with 503 SlowDown, as S3 does under load.
    s3_proxy.start("--fail-first", "3")
    store = ObjectStore("s3://rlflow-test/throttle", endpoint_url=s3_proxy.endpoint_url, retry_attempts=5,
                        retry_max_wait_s=0.2)
    store.put_bytes("k", b"after throttling")
    assert store.get_bytes("k") == b"after throttling"


# -------------------------------------------------------------- classification


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


@pytest.mark.parametrize(("err", "kind"), [
    (_client_error("SlowDown", 503), "transient"),
    (_client_error("InternalError", 500), "transient"),
    (_client_error("ServiceUnavailable", 503), "transient"),
    (_client_error("Weird", 502), "transient"),
    (_client_error("TooManyRequests", 429), "transient"),
    (_client_error("AccessDenied", 403), "denied"),
    (_client_error("InvalidAccessKeyId", 403), "denied"),
    (_client_error("NoSuchBucket", 404), "no_bucket"),
    (_client_error("NoSuchKey", 404), "not_found"),
    (_client_error("InvalidArgument", 400), "permanent"),
    (EndpointConnectionError(endpoint_url="http://x"), "transient"),
    (ReadTimeoutError(endpoint_url="http://x"), "transient"),
    (ConnectTimeoutError(endpoint_url="http://x"), "transient"),
    (ConnectionResetError(), "transient"),
    (ConnectionRefusedError(), "transient"),
    (TimeoutError(), "transient"),
    (FileNotFoundError("x"), "not_found"),
    (PermissionError("x"), "denied"),
    (ValueError("x"), "permanent"),
])  # fmt: skip
def test_classify_error(err: BaseException, kind: str) -> None:
    assert classify_error(err) == kind


def test_translated_errors_are_classified_by_their_cause() -> None:
    wrapped = OSError(16, "busy")
    wrapped.__cause__ = _client_error("SlowDown", 503)
    assert classify_error(wrapped) == "transient"
    denied = PermissionError("Forbidden")
    denied.__cause__ = _client_error("403", 403)
    assert classify_error(denied) == "denied"


def test_retry_backoff_is_bounded(tmp_path) -> None:
    store = ObjectStore(str(tmp_path), retry_attempts=6, retry_max_wait_s=0.05)
    calls: list[float] = []

    def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 5:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert store._retry("read", "k", flaky) == "ok"
    assert len(calls) == 5
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert all(g <= 0.2 for g in gaps)

    permanent: list[int] = []

    def denied() -> None:
        permanent.append(1)
        raise PermissionError("no")

    with pytest.raises(StoreError, match="access denied"):
        store._retry("read", "k", denied)
    assert permanent == [1]


# ------------------------------------------------------------------- credentials


@pytest.mark.slow
def test_credentials_never_leak(s3_env, caplog) -> None:
    secret = s3_env["AWS_SECRET_ACCESS_KEY"]
    cfg = StorageConfig(root="s3://rlflow-test/leak", access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
                        secret_access_key=secret, retry_attempts=2, retry_max_wait_s=0.1,
                        endpoint_url="http://127.0.0.1:9")
    caplog.set_level(logging.DEBUG, logger="rlflow")
    store = ObjectStore.from_config(cfg)
    with pytest.raises(StoreUnavailable) as info:
        store.put_bytes("k", b"1")
    texts = [repr(store), str(store), str(info.value), caplog.text, repr(cfg), str(cfg.model_dump())]
    assert all(secret not in t for t in texts)
    assert secret.encode() not in pickle.dumps(store)
    # A pickled store takes its credentials from the receiving process's environment.
    clone = pickle.loads(pickle.dumps(ObjectStore("s3://rlflow-test/leak", **FAST)))
    clone.put_bytes("k", b"works")
    assert clone.get_bytes("k") == b"works"


@pytest.mark.slow
def test_config_credentials_are_used(s3_env, monkeypatch) -> None:
    key, secret = s3_env["AWS_ACCESS_KEY_ID"], s3_env["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-in-env")
    with pytest.raises(StoreError, match="access denied"):
        ObjectStore("s3://rlflow-test/cfg", **FAST).put_bytes("k", b"1")
    cfg = StorageConfig(root="s3://rlflow-test/cfg", access_key_id=key, secret_access_key=secret)
    ObjectStore.from_config(cfg).put_bytes("k", b"1")


def test_unsupported_root_is_refused() -> None:
    with pytest.raises(InfraError, match="only local folders and s3://"):
        ObjectStore("gcs://bucket/x")


@pytest.mark.effect_of("storage.max_concurrency")
def test_max_concurrency_from_the_config(tmp_path) -> None:  # noqa: ANN001
    """storage.max_concurrency: the threads that copy a checkpoint's or an export's files at once."""
    def threads(limit: int) -> int:
        store = ObjectStore.from_config(StorageConfig(root=str(tmp_path), max_concurrency=limit))
        barrier, seen = threading.Barrier(2, timeout=0.5), set()

        def work(_: int) -> None:
            seen.add(threading.get_ident())
            try:
                barrier.wait()  # two at once only when two threads run
            except threading.BrokenBarrierError:
                pass

        store.map_parallel(work, list(range(4)))
        return len(seen)

    assert threads(1) == 1 and threads(8) >= 2


@pytest.mark.effect_of("storage.retry_attempts", "storage.retry_max_wait_s")
def test_retries_come_from_the_config(caplog: pytest.LogCaptureFixture) -> None:
    """storage.retry_attempts and storage.retry_max_wait_s: the tries of a transient failure (a refused
    connection) and the cap of each backoff wait, as the store's warnings and its error report them."""
    def fail(**settings: object) -> tuple[str, list[str]]:
        cfg = StorageConfig(root="s3://rlflow-test/retries", endpoint_url="http://127.0.0.1:9", access_key_id="k",
                            secret_access_key="s", **settings)  # type: ignore[arg-type]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlflow"), pytest.raises(StoreUnavailable) as info:
            ObjectStore.from_config(cfg).put_bytes("k", b"1")
        return str(info.value), [r.getMessage().rsplit(" in ", 1)[1] for r in caplog.records if "retry" in r.getMessage()]

    error, waits = fail(retry_attempts=3)
    assert "failed after 3 tries" in error and len(waits) == 2 and waits[1] != "0.0s", waits  # 0.2-0.4 s
    error, waits = fail(retry_attempts=3, retry_max_wait_s=0.01)
    assert "failed after 3 tries" in error and waits == ["0.0s", "0.0s"], waits
    assert "failed after 2 tries" in fail(retry_attempts=2)[0]
