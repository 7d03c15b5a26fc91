"""`rlflow doctor`: the table's rows, the exit code, and bounded time when storage cannot be reached."""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import pytest

from flows.commands import doctor
from flows.commands.doctor import Check, check_storage, run_checks
from flows.config import load_config


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state folder with no stack running, a fresh model cache, a wide table."""
    monkeypatch.setenv("RLFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "300")


def _cli(*args: str) -> int:
    parser = argparse.ArgumentParser(prog="rlflow")
    doctor.register(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["doctor", *args])
    return int(parsed.func(parsed))


def _rows(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_local_storage_root_is_ready(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "runs"
    rows = _rows(run_checks(None, [f"storage.root={root}"]))
    ready = ("config", "torch", "gloo", "GPUs", "transformers", "ray", "prefect", "storage", "model cache")
    for name in ready:
        assert rows[name].status == "ok", rows[name]
    assert "CPU build" in rows["torch"].detail or "CUDA" in rows["torch"].detail
    # The stack is not running here: not a failure, `rlflow train` starts it, and the fix says so.
    for name in ("ray head", "prefect server"):
        assert rows[name].status == "not running" and not rows[name].blocks
        assert "rlflow train" in rows[name].fix
    assert not any(check.blocks for check in rows.values())
    assert list(root.iterdir()) == [], "the probe object and its folder are gone"

    assert _cli(f"storage.root={root}") == 0
    out = capsys.readouterr().out
    for text in ("rlflow doctor", "storage", "gloo", "torch", "ray head", "not running", "ready"):
        assert text in out


def test_an_unreachable_s3_endpoint_fails_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "doctor")  # signed requests, so the connection is what fails
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "doctor")
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    code = _cli("storage.root=s3://nope/x", f"storage.endpoint_url={endpoint}")
    assert time.monotonic() - started < 15.0
    assert code == 1
    out = capsys.readouterr().out
    assert "storage" in out and "failed" in out and "not ready: storage" in out

    rows = _rows(run_checks(None, ["storage.root=s3://nope/x", f"storage.endpoint_url={endpoint}"]))
    assert rows["storage"].status == "failed" and rows["storage"].blocks
    assert endpoint in rows["storage"].fix and "rlflow infra s3" in rows["storage"].fix


@pytest.mark.slow
@pytest.mark.integration
def test_s3_storage_probe_against_the_dev_server(s3_server, s3_env, monkeypatch: pytest.MonkeyPatch) -> None:
    ok = check_storage(load_config(None, [f"storage.root=s3://{s3_server.bucket}/doctor"]))
    assert ok.status == "ok", ok

    no_bucket = check_storage(load_config(None, ["storage.root=s3://no-such-bucket/x"]))
    assert no_bucket.status == "failed" and "create the bucket" in no_bucket.fix, no_bucket

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    denied = check_storage(load_config(None, [f"storage.root=s3://{s3_server.bucket}/doctor"]))
    assert denied.status == "failed" and "AWS_SECRET_ACCESS_KEY" in denied.fix, denied


def test_an_unwritable_local_root_fails(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    row = check_storage(load_config(None, [f"storage.root={blocker}/runs"]))
    assert row.status == "failed" and "storage.root=PATH" in row.fix, row


def test_a_bad_config_is_one_failed_row(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows(run_checks(None, ["actor.lr=fast"]))
    assert rows["config"].status == "failed" and "actor.lr" in rows["config"].detail
    assert "storage" not in rows, "checks that need the config are left out"
    assert rows["torch"].status == "ok"


def test_missing_logger_packages_block(monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.loggers

    monkeypatch.setattr(flows.loggers, "missing_packages", lambda names: ["wandb"])
    row = doctor.check_loggers(load_config(None, ["trainer.loggers=wandb"]))
    assert row.status == "missing" and row.blocks and "rlflow[loggers]" in row.fix
    assert not doctor.check_loggers(load_config()).blocks


def test_a_hanging_check_becomes_a_failed_row() -> None:
    started = time.monotonic()
    rows = doctor._bounded("slow", 0.2, lambda: [time.sleep(5), Check("slow", "ok", "")][1])
    assert time.monotonic() - started < 1.0
    assert rows[0].status == "failed" and "no answer within" in rows[0].detail
    assert doctor._bounded("boom", 1.0, lambda: [][0])[0].status == "failed"


def test_cuda_asked_for_without_a_gpu_fails() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    rows = _rows(doctor.check_distributed("cuda"))
    assert rows["GPUs"].status == "failed" and "trainer.device=cpu" in rows["GPUs"].fix


def test_vllm_is_informative_unless_configured() -> None:
    row = doctor.check_vllm(required=False)
    assert not row.blocks
    if row.status == "missing":
        assert doctor.check_vllm(required=True).blocks


def test_infra_s3_without_moto_says_which_extra_to_install() -> None:
    """The main install leaves moto out: `rlflow infra s3` says so in one line, naming the extra."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['moto'] = None\n"  # as if moto were not installed
            "from flows.cli import main; sys.exit(main(['infra', 's3', '--port', '0']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "rlflow: error: rlflow infra s3 runs moto's S3 server, which the main install leaves out: "
        "pip install -c constraints-cpu.txt -e '.[s3]'"], proc.stderr


@pytest.mark.effect_of("ray.address")
def test_unreachable_ray_address() -> None:
    """ray.address: an external cluster, probed where `rlflow train` would connect (no local head then)."""
    address = f"127.0.0.1:{_closed_port()}"
    rows = _rows(run_checks(None, [f"ray.address={address}"]))
    assert rows["ray head"].status == "failed" and f"ray.address={address} does not answer" in rows["ray head"].detail
    assert _rows(run_checks(None, []))["ray head"].status == "not running"  # the default: the local head
