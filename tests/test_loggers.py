"""flows/loggers.py: each backend writes files that are read back here, with no network.

The network is closed in two ways: Python sockets may only connect to loopback or Unix sockets (an
attempt elsewhere fails the test), and the proxy / W&B endpoint variables point at a closed local
port, for wandb-core, the Go process that W&B runs beside Python.
"""

from __future__ import annotations

import glob
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ConfigError
from flows.config import load_config
from flows.loggers import (
    PACKAGES,
    MetricLoggers,
    install_hint,
    missing_packages,
    require_packages,
    run_log_dir,
)

CONFIG = {"trainer": {"project": "rlflow-test", "total_iterations": 3},
          "actor": {"lr": 1e-5, "clip": [0.2, 0.3]}}  # fmt: skip
METRICS = [
    {"critic/score/mean": 0.25, "timing_s/step": 1.5, "actor/pg_loss": -0.1},
    {"critic/score/mean": 0.5, "timing_s/step": 1.25, "actor/pg_loss": -0.2, "val/score/mean": 0.75},
]


@pytest.fixture()
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """No network for this test; yields the list of refused connection attempts (must stay empty)."""
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_DISABLE_TELEMETRY",
                "WANDB_ERROR_REPORTING", "NO_PROXY", "no_proxy"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "WANDB_BASE_URL"):
        monkeypatch.setenv(key, closed)
    monkeypatch.setenv("WANDB_SILENT", "true")
    refused: list[Any] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            refused.append(address)
            raise OSError(f"test: no network ({address})")
        return real_connect(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in (None, "", "localhost") and not _is_loopback(host):
            refused.append(host)
            raise socket.gaierror(f"test: no network ({host})")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield refused
    assert not refused, f"a logger tried the network: {refused}"


def _is_loopback(host: Any) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _log_run(names: list[str], log_dir: Path, run_id: str = "run-1", steps: range = range(2)) -> None:
    with MetricLoggers.create(names, run_id=run_id, log_dir=log_dir, config=CONFIG, project="rlflow-test") as loggers:
        assert loggers.names == names
        for step in steps:
            loggers.log(step + 1, METRICS[step])


# -- tensorboard ------------------------------------------------------------------------------------


def _tb_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of every event file in `folder`: TFRecord frames (length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_tensorboard_writes_readable_scalars(tmp_path: Path, offline: list[Any]) -> None:
    pytest.importorskip("tensorboardX")
    _log_run(["tensorboard"], tmp_path)
    scalars = _tb_scalars(tmp_path / "tensorboard")
    assert scalars["critic/score/mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["timing_s/step"] == [(1, 1.5), (2, 1.25)]
    assert scalars["val/score/mean"] == [(2, 0.75)]


# -- wandb ------------------------------------------------------------------------------------------


def _wandb_history(run_file: Path) -> list[dict[str, str]]:
    """History rows of an offline `.wandb` file: a LevelDB-style log (7-byte file header, 32 KiB
    blocks of records framed as crc32, uint16 length, type) of wandb_internal_pb2.Record protos."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, chunk, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a frame header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record.FromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json
                             for item in record.history.item})  # fmt: skip
    return rows


def test_wandb_offline_run_holds_the_history(tmp_path: Path, offline: list[Any]) -> None:
    pytest.importorskip("wandb")
    _log_run(["wandb"], tmp_path, run_id="run-1")
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*-run-1"))
    assert len(runs) == 1, "one offline run folder under <log_dir>/wandb"
    # wandb's own service process writes the file: `finish()` can return before its last records are
    # there (seen under load: the history came a moment later), so read until both rows are in, 30 s at most
    deadline = time.monotonic() + 30
    while True:
        try:
            rows = _wandb_history(Path(runs[0]) / "run-run-1.wandb")
        except Exception:  # noqa: BLE001 - a record still being written
            rows = []
        if len(rows) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(row["_step"], row["critic/score/mean"]) for row in rows] == [("1", "0.25"), ("2", "0.5")]
    assert rows[1]["val/score/mean"] == "0.75"


# -- mlflow -----------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # SQLAlchemy 2.1 on MLflow's store
def test_mlflow_local_store_reads_back_and_resumes(tmp_path: Path, offline: list[Any]) -> None:
    pytest.importorskip("mlflow")
    _log_run(["mlflow"], tmp_path, steps=range(1))
    _log_run(["mlflow"], tmp_path, steps=range(1, 2))  # a resumed run goes on in the same MLflow run
    # MLflow's telemetry is off under pytest anyway (PYTEST_CURRENT_TEST); in a run this keeps it off.
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rlflow-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "run-1" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5)]
    assert run.data.params["actor.lr"] == "1e-05" and run.data.params["actor.clip"] == "[0.2, 0.3]"


# -- the facade -------------------------------------------------------------------------------------


class _Recorder:
    name = "recorder"

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.logged, self.closed = fail, [], None

    def log(self, step: int, metrics: Any) -> None:
        if self.fail:
            raise RuntimeError("disk full")
        self.logged.append((step, dict(metrics)))

    def close(self, *, failed: bool = False) -> None:
        self.closed = failed


def test_a_failing_backend_is_switched_off_and_non_numbers_dropped(caplog: pytest.LogCaptureFixture) -> None:
    good, bad = _Recorder(), _Recorder(fail=True)
    loggers = MetricLoggers([good, bad])
    loggers.log(1, {"a": 1, "b": "text", "c": 2.5})
    loggers.log(2, {"a": 2, "b": "text"})
    assert good.logged == [(1, {"a": 1.0, "c": 2.5}), (2, {"a": 2.0})]
    assert bad.closed is True and loggers.loggers == [good]
    assert sum("not a number" in r.message for r in caplog.records) == 1
    with loggers:
        pass
    assert good.closed is False


def test_no_loggers_is_a_no_op(tmp_path: Path) -> None:
    with MetricLoggers.create([], run_id="r", log_dir=tmp_path / "logs", config={}) as loggers:
        loggers.log(1, {"a": 1.0})
    assert loggers.loggers == []


def test_a_missing_package_is_one_config_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a))  # fmt: skip
    assert missing_packages(["tensorboard", "wandb", "mlflow"]) == ["wandb", "mlflow-skinny"]
    with pytest.raises(ConfigError) as err:
        MetricLoggers.create(["wandb", "mlflow"], run_id="r", log_dir="/nonexistent/never", config={})
    message = str(err.value)
    assert "pip install 'rlflow[loggers]'" in message and "wandb" in message and "mlflow-skinny" in message
    assert "\n" not in message
    assert install_hint() == "pip install 'rlflow[loggers]'"
    with pytest.raises(ConfigError, match="unknown logger 'console'"):
        require_packages(["console"])


def test_every_backend_has_its_package_in_the_extra() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    extra = " ".join(pyproject["project"]["optional-dependencies"]["loggers"]).lower()
    for package in PACKAGES.values():
        assert package.pip.lower() in extra


def test_config_fields() -> None:
    cfg = load_config(None, ["trainer.loggers=tensorboard,mlflow", "trainer.log_dir=/tmp/tb"])
    assert cfg.trainer.loggers == ["tensorboard", "mlflow"] and cfg.trainer.log_dir == "/tmp/tb"
    assert load_config(None, ["trainer.loggers=[wandb]"]).trainer.loggers == ["wandb"]
    assert load_config().trainer.loggers == [] and load_config().trainer.log_dir is None
    with pytest.raises(ConfigError, match="trainer.loggers='console' is not allowed.*'tensorboard', 'wandb'"):
        load_config(None, ["trainer.loggers=console"])
    with pytest.raises(ConfigError, match="at most once"):
        load_config(None, ["trainer.loggers=wandb,wandb"])
    with pytest.raises(ConfigError, match="trainer.log_dir.*local folder"):
        load_config(None, ["trainer.log_dir=s3://bucket/logs"])


def test_run_log_dir(tmp_path: Path) -> None:
    assert run_log_dir(None, storage_root=str(tmp_path), run_id="r1") == tmp_path / "r1" / "logs"
    assert run_log_dir(None, storage_root=f"file://{tmp_path}", run_id="r1") == tmp_path / "r1" / "logs"
    assert run_log_dir(None, storage_root="s3://b/p", run_id="r1") == Path("runs/r1/logs").resolve()
    assert run_log_dir(str(tmp_path / "tb"), storage_root="s3://b/p", run_id="r1") == tmp_path / "tb" / "r1"
