"""Bad input through the real CLI (`python -m flows.cli train ...` in a subprocess): each fails with one
`rlflow: error: ...` line naming the input, exit code 2, no traceback, and nothing written — no run
folder (or S3 object) for a new run, every file of a resumed run byte for byte as it was.

Every check here happens before the stack starts: the CLI runs against a stack folder that must never
come into being (`RLFLOW_HOME` under tmp_path), so a check that slipped behind the stack start fails the
test instead of starting a Prefect server and a Ray head. Only the credentials test needs a service,
the session's S3 server.

The commands run in one long-lived CLI process for the module (tests/services.WarmCli: the same
`flows.cli.main`, its exit code and output), each with its own `RLFLOW_HOME` and cache: what is checked
is the command's answer and what it wrote, not its process, and 34 process starts of ~5 s each are saved.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.services import REPO, WarmCli

pytestmark = pytest.mark.integration
GOOD_ROWS = 32  # data.train_batch_size of the default config: the smallest training set a run accepts


def row(i: int, **change: Any) -> dict[str, Any]:
    """A valid verl-layout prompt row; `change` replaces (or, with None, removes) top-level keys."""
    record: dict[str, Any] = {
        "data_source": "rlflow/arith",
        "prompt": [{"role": "user", "content": f"What is {i} + 2?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
        "extra_info": {"index": i},
    }
    record.update(change)
    return {k: v for k, v in record.items() if v is not None}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def good_rows() -> list[dict[str, Any]]:
    return [row(i) for i in range(GOOD_ROWS)]


class Offline:
    """`rlflow train` with a stack folder that must stay absent and no AWS settings from outside."""

    def __init__(self, tmp: Path, model: Path, cli: WarmCli) -> None:
        self.home = tmp / "stack-never-started"
        self.model = model
        self.root = tmp / "runs"
        self.env = {"RLFLOW_HOME": str(self.home), "RLFLOW_CACHE": str(tmp / "cache")}
        self.cli = cli

    def train(self, *args: str, config: str | None = None, resume: str | None = None,
              env: dict[str, str] | None = None) -> tuple[str, float]:
        """`rlflow train [config] storage.root=... [model.path=... trainer.run_id=bad] args [--resume RUN]`:
        assert it failed cleanly before the stack; return (the error line, seconds)."""
        base = [f"storage.root={self.root}"]
        if resume is None:
            base += [f"model.path={self.model}", "trainer.run_id=bad"]
        cmd = ["train", *([config] if config else []), *base, *args, *(["--resume", resume] if resume else [])]
        start = time.monotonic()
        proc = self.cli(*cmd, env={**self.env, **(env or {})}, timeout=300)
        seconds = time.monotonic() - start
        errors = [line for line in proc.stderr.splitlines() if line.startswith("rlflow: error:")]
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr[-4000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
        assert not self.home.exists(), "the stack was started before the input was checked"
        if resume is None:
            assert not (self.root / "bad").exists(), "a run folder was written for a bad input"
        return errors[0], seconds


@pytest.fixture(scope="module")
def offline_cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmCli]:
    """The module's CLI process: no AWS settings from outside, a stack folder and cache of its own (each
    command names its test's own)."""
    folder = tmp_path_factory.mktemp("offline-cli")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(RLFLOW_HOME=str(folder / "stack-never-started"), RLFLOW_CACHE=str(folder / "cache"),
               PYTHONPATH=str(REPO))
    warm = WarmCli(env, folder)
    yield warm
    warm.close()
    assert not (folder / "stack-never-started").exists()


@pytest.fixture
def offline(tmp_path: Path, tiny_model_dir: Path, offline_cli: WarmCli) -> Iterator[Offline]:
    runner = Offline(tmp_path, tiny_model_dir, offline_cli)
    try:
        yield runner
    finally:
        if (runner.home / "stack").exists():  # a check ran too late: stop what it started
            from infra.config import StackConfig
            from infra.stack import LocalStack

            LocalStack(StackConfig(home=str(runner.home))).down()


# ----------------------------------------------------------------------------------------- data


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


MALFORMED = {
    # id: (file kind, the bad row, what the message must name)
    "missing-prompt": ("jsonl", row(3, prompt=None), ["row 3", "'prompt'", "missing"]),
    "missing-ground-truth": ("parquet", row(3, reward_model={"style": "rule"}),
                             ["row 3", "'reward_model.ground_truth'", "missing"]),
    "prompt-not-a-list": ("jsonl", row(3, prompt="What is 1 + 2?"), ["row 3", "'prompt'", "got str"]),
    "data-source-not-a-string": ("jsonl", row(3, data_source=7), ["row 3", "'data_source'", "got 7"]),
    "ground-truth-a-bool": ("jsonl", row(3, reward_model={"ground_truth": True}),
                            ["row 3", "'reward_model.ground_truth'", "got bool True"]),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_dataset_row(case: str, offline: Offline, tmp_path: Path) -> None:
    kind, bad, named = MALFORMED[case]
    rows = good_rows()
    rows[3] = bad
    path = tmp_path / f"train.{kind}"
    write_jsonl(path, rows) if kind == "jsonl" else _parquet(path, rows)
    error, _ = offline.train(f"data.train_files=[{path}]")
    assert str(path) in error and all(part in error for part in named), error


def test_empty_dataset(offline: Offline, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "empty.jsonl", [])
    error, _ = offline.train(f"data.train_files=[{path}]")
    assert str(path) in error and "no rows" in error, error


def test_every_prompt_longer_than_the_limit(offline: Offline, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", good_rows())
    error, _ = offline.train(f"data.train_files=[{path}]", "data.max_prompt_length=3")
    assert f"every one of the {GOOD_ROWS} train prompts" in error and "data.max_prompt_length=3" in error, error
    assert str(path) in error, error


def test_sft_data_without_an_assistant_turn(offline: Offline, tmp_path: Path) -> None:
    """`rlflow train configs/tiny_sft.yaml` on a conversation with no assistant turn: one line naming the
    row, before the stack."""
    talk = [{"messages": [{"role": "user", "content": f"{i} + 1?"}, {"role": "assistant", "content": f"#### {i + 1}"}]}
            for i in range(GOOD_ROWS)]
    talk[3] = {"messages": [{"role": "user", "content": "hello"}]}
    path = write_jsonl(tmp_path / "sft.jsonl", talk)
    error, _ = offline.train(f"data.train_files=[{path}]", config=str(REPO / "configs" / "tiny_sft.yaml"))
    assert error == (f"rlflow: error: {path}: row 3: key 'messages': no assistant turn in [{{'role': 'user', "
                     "'content': 'hello'}]: SFT trains on the assistant's turns only, so a conversation needs at "
                     "least one"), error


def test_preference_data_without_a_rejected_column(offline: Offline, tmp_path: Path) -> None:
    """`rlflow train configs/tiny_dpo.yaml` on pairs with no rejected response: one line naming the row."""
    pairs = [{"prompt": f"{i} + 1?", "chosen": f"#### {i + 1}"} for i in range(GOOD_ROWS)]
    path = _parquet(tmp_path / "pairs.parquet", pairs)
    error, _ = offline.train(f"data.train_files=[{path}]", config=str(REPO / "configs" / "tiny_dpo.yaml"))
    assert error == (f"rlflow: error: {path}: row 0: key 'rejected': missing; DPO needs a chosen and a rejected "
                     "response to each prompt"), error


def test_a_teacher_with_another_tokenizer(offline: Offline, tmp_path: Path) -> None:
    """On-policy distillation with a teacher whose tokenizer is a byte-level BPE (qwen2's family), the
    student's the char-level tiny one: one line, before the stack."""
    import shutil

    from engine.demo.families import FAMILIES, build_tokenizer, task_corpus

    teacher = tmp_path / "teacher"
    build_tokenizer(FAMILIES["qwen2"], task_corpus("arith", 0, rows=200)).save_pretrained(teacher)
    shutil.copy(offline.model / "config.json", teacher / "config.json")
    error, _ = offline.train(f"teacher.path={teacher}",
                             config=str(REPO / "configs" / "tiny_distill.yaml"))
    assert error.startswith(f"rlflow: error: teacher.path='{teacher}' is not allowed: its tokenizer differs from the "
                            "student's ("), error
    assert error.endswith("distillation compares log-probs token by token, so teacher and student need the same "
                          "tokenizer"), error


def test_a_model_too_large_for_this_machine(offline: Offline, tmp_path: Path) -> None:
    """Llama 2 70B's config.json (no weights): the engine's memory, estimated from it, is refused in one line
    with the figures, before the stack and any rank start (engine/workers/memory.py)."""
    from tests.engine.test_memory_estimate import LLAMA_70B

    huge = tmp_path / "llama-70b"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps(LLAMA_70B))
    error, _ = offline.train(f"model.path={huge}", f"model.tokenizer_path={offline.model}")
    assert error.startswith("rlflow: error: the engine would need at least "), error
    assert "; this machine has " in error and "or choose a smaller model.path" in error, error


# --------------------------------------------------------------------------------------- rewards

REWARDS = '''
def raises(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 / len(solution_str)          # ZeroDivisionError on the empty response

def nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")

def string(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0" if solution_str == ground_truth else 0.0   # only the right answer breaks it
'''
BROKEN = {"raises": "ZeroDivisionError", "nan": "returned nan", "string": "returned '1.0'"}


@pytest.mark.parametrize("fn", list(BROKEN))
def test_broken_reward_fails_before_the_run(fn: str, offline: Offline, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", good_rows())
    module = tmp_path / "my_reward.py"
    module.write_text(REWARDS)
    error, _ = offline.train(f"data.train_files=[{data}]", f"reward.function={module}:{fn}")
    assert BROKEN[fn] in error and "data_source 'rlflow/arith'" in error and "row 0" in error, error
    assert f"{data}:0" in error, error  # the file row the preflight scored


# ---------------------------------------------------------------------------------------- config

BAD_CONFIG = {
    # id: (overrides, what the message must name)
    "unknown-key": (["trainer.iterations=3"], "trainer.iterations"),
    "out-of-range": (["data.train_batch_size=0"], "data.train_batch_size=0"),
    "wrong-type": (["actor.lr=fast"], "actor.lr"),
    "missing-model-dir": (["model.path=/nonexistent/model"], "model.path '/nonexistent/model'"),
    "batch-larger-than-data": (["data.train_batch_size=64"], "data.train_batch_size=64"),
    "cuda-not-yet": (["trainer.device=cuda"], "trainer.device"),
    "lora-target-not-in-model": (["actor.lora.rank=4", "actor.lora.target_modules=[q_proj,nope_proj]"],
                                 "actor.lora.target_modules: 'nope_proj' is not a module"),
    "lora-module-to-save-not-in-model": (["actor.lora.rank=4", "actor.lora.modules_to_save=[nope]"],
                                         "actor.lora.modules_to_save: 'nope' is not a module"),
    "export-merged-without-lora": (["trainer.export_merged=true"], "trainer.export_merged"),
    "critic-lora-without-critic": (["critic.lora.rank=4"], "critic.lora.rank"),
    # refused by flows.plan.check_inputs, where the data's rewards are known
    "format-weight-without-a-format-reward": (["reward.format_weight=0.5"], "reward.format_weight=0.5 weighs a "
                                              "reward's format component, and the data's rewards (gsm8k) have none"),
    # issue 47: a traceback at engine setup (torch.manual_seed) and at the first retry (Prefect's delay) on c4b7975
    "seed-past-torch": ([f"trainer.seed={2**100}"], f"trainer.seed={2**100} is not allowed: must be an integer in "
                                                   f"[0, {2**63 - 1}]"),
    "retry-delay-past-a-day": (["trainer.stage_retry_delays_s=[2, 1.0e+300]"], "trainer.stage_retry_delays_s=[2, 1e+300] "
                                                                              "is not allowed: each must be in [0, 86400]"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIG))
def test_bad_config_value(case: str, offline: Offline, tmp_path: Path) -> None:
    overrides, named = BAD_CONFIG[case]
    data = write_jsonl(tmp_path / "train.jsonl", good_rows())
    error, _ = offline.train(f"data.train_files=[{data}]", *overrides)
    assert named in error, error


# ---------------------------------------------------------------------------------------- storage


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when this returns: connections are refused


def test_unreachable_s3_endpoint_fails_fast(offline: Offline, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", good_rows())
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    env = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLEEXAMPLE00", "AWS_SECRET_ACCESS_KEY": "not-a-real-secret"}
    error, seconds = offline.train(f"data.train_files=[{data}]", "storage.root=s3://b/p",
                                   f"storage.endpoint_url={endpoint}", env=env)
    assert "storage.root=s3://b/p is unreachable at " + endpoint in error, error
    assert "storage.endpoint_url" in error, error
    assert seconds < 30, f"took {seconds:.1f}s"


@pytest.mark.slow
def test_wrong_s3_credentials(offline: Offline, tmp_path: Path, s3_server: Any) -> None:
    from infra.s3server import DEV_ACCESS_KEY_ID, DEV_SECRET_ACCESS_KEY

    data = write_jsonl(tmp_path / "train.jsonl", good_rows())
    wrong = "wrong-secret-" + os.urandom(6).hex()
    root = f"s3://{s3_server.bucket}/bad-credentials"
    error, _ = offline.train(f"data.train_files=[{data}]", f"storage.root={root}",
                             f"storage.endpoint_url={s3_server.endpoint_url}",
                             f"storage.access_key_id={DEV_ACCESS_KEY_ID}", env={"AWS_SECRET_ACCESS_KEY": wrong})
    assert f"access denied to {root}/bad/run.json (403" in error, error  # a HEAD: no error code in the body
    assert "storage.secret_access_key" in error and wrong not in error, error
    import s3fs

    fs = s3fs.S3FileSystem(key=DEV_ACCESS_KEY_ID, secret=DEV_SECRET_ACCESS_KEY, endpoint_url=s3_server.endpoint_url)
    assert not fs.exists(f"{s3_server.bucket}/bad-credentials"), "an object was written with bad credentials"


def test_a_secret_on_the_command_line_is_refused(offline: Offline) -> None:
    secret = "s3cr3t-" + os.urandom(6).hex()
    error, _ = offline.train(f"storage.secret_access_key={secret}")
    assert error == ("rlflow: error: storage.secret_access_key on the command line: every user of this machine "
                     "can read a command line (/proc/<pid>/cmdline); set AWS_SECRET_ACCESS_KEY in the environment, "
                     "or use an AWS credentials file (AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE)"), error


@pytest.mark.parametrize("value", ["1234567890", "[abc, 99887766]", "{k: 55443322}"])
def test_a_secret_is_not_echoed_whatever_its_type(value: str, tmp_path: Path) -> None:
    """A secret YAML does not read as a string (a number, a list, a mapping) fails validation: the
    error names the setting and hides the value."""
    from engine.errors import ConfigError
    from flows.config import load_config

    config = tmp_path / "config.yaml"
    config.write_text(f"storage:\n  secret_access_key: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(config, [])
    assert str(err.value) == "storage.secret_access_key=<hidden> is not allowed: Input should be a valid string"
    for digits in ("1234567890", "99887766", "55443322"):
        assert digits not in str(err.value)


# ---------------------------------------------------------------------------------------- resume


def test_resume_of_a_run_that_does_not_exist(offline: Offline) -> None:
    error, _ = offline.train(resume="no-such-run")
    assert "--resume no-such-run: no run 'no-such-run' under " + str(offline.root) in error, error
    assert not offline.root.exists() or not any(offline.root.iterdir())


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def existing_run(offline: Offline, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A run as `open_run` leaves it (run.json, the released lease) plus a finished iteration's metrics."""
    from flows.config import load_config
    from flows.plan import open_run

    data = write_jsonl(tmp_path / "train.jsonl", good_rows())
    cfg = load_config(None, [f"model.path={offline.model}", f"storage.root={offline.root}", "trainer.run_id=kept",
                             f"data.train_files=[{data}]"])
    run = open_run(cfg, "kept", resume=False)
    run.runs.write_metrics(1, {"critic/score/mean": 0.25})
    run.lease.release()
    yield "kept", offline.root / "kept"


RESUME_REFUSED = {
    # id: (CONFIG or None, overrides, what the message must name)
    "changes-model": (None, ["model.path={tmp}/another-model"], "--resume kept: the config changes model.path"),
    "config-changes-model": ("configs/tiny_grpo.yaml", [], "--resume kept: the config changes model.path"),
    # a reward the run did not begin with: what runs on resume is the run's own code (see TAMPERED)
    "other-reward": (None, ["reward.function={tmp}/my_reward.py:nan"],
                     "--resume kept: run.json has reward.function=None where your config and command line give"),
}


@pytest.mark.parametrize("case", list(RESUME_REFUSED))
def test_resume_refused_leaves_the_run_intact(case: str, offline: Offline, existing_run: tuple[str, Path],
                                              tmp_path: Path) -> None:
    run_id, folder = existing_run
    (tmp_path / "another-model").mkdir()
    (tmp_path / "my_reward.py").write_text(REWARDS)
    before = snapshot(folder)
    assert {"run.json", "lock.json", "metrics/iter_000001.json"} <= set(before)
    config, overrides, named = RESUME_REFUSED[case]
    error, _ = offline.train(*(o.format(tmp=tmp_path) for o in overrides), config=config, resume=run_id)
    assert named in error, error
    assert snapshot(folder) == before  # every file, its bytes and its mtime


TAMPERED = {  # what whoever writes the bucket puts into run.json: code to run, files to write elsewhere
    "reward.function": "{tmp}/evil.py:reward",
    "rollout.env": "{tmp}/evil.py:reward",
    "rollout.agent": "{tmp}/evil.py:reward",
    "model.trust_remote_code": True,
    "trainer.log_dir": "{tmp}/elsewhere",
}


@pytest.mark.parametrize("key", list(TAMPERED))
def test_a_tampered_run_json_chooses_no_code(key: str, offline: Offline, existing_run: tuple[str, Path],
                                            tmp_path: Path) -> None:
    """A stored value of a setting that names code (or where the run writes) is refused on resume,
    naming the field and both values, before anything is imported or written."""
    run_id, folder = existing_run
    (tmp_path / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n"
                                      "def reward(data_source, response, ground_truth, extra_info=None):\n"
                                      "    return 1.0\n")
    value = TAMPERED[key]
    value = value.format(tmp=tmp_path) if isinstance(value, str) else value
    info = json.loads((folder / "run.json").read_text())
    section, field = key.rsplit(".", 1)
    node = info["config"]
    for part in section.split("."):
        node = node[part]
    original, node[field] = node[field], value
    (folder / "run.json").write_text(json.dumps(info))
    before = snapshot(folder)
    error, _ = offline.train(resume=run_id)
    assert f"--resume {run_id}: run.json has {key}={value!r} where your config and command line give " \
           f"{original!r}" in error, error
    assert not (tmp_path / "ran").exists() and not (tmp_path / "elsewhere").exists()
    assert snapshot(folder) == before


def test_a_tampered_run_json_confines_nothing(offline: Offline, existing_run: tuple[str, Path], tmp_path: Path) -> None:
    """How the run's code is confined is not run.json's to say either: with `reward.sandbox.isolation: none`
    written into it, c4b7975 resumed with one warning and ran the episodes unconfined. The edit breaks the
    record's signature (infra/record_key.py), so none of its settings is taken and the resume is refused."""
    run_id, folder = existing_run
    info = json.loads((folder / "run.json").read_text())
    info["config"]["reward"]["sandbox"]["isolation"] = "none"
    (folder / "run.json").write_text(json.dumps(info))
    before = snapshot(folder)
    error, _ = offline.train(f"model.path={offline.model}", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
                             resume=run_id)
    assert (f"--resume {run_id}: run.json has reward.sandbox.isolation='none' where your config and "
                            "command line give 'bwrap', and its settings are not taken because its signature does not "
                            "match its contents") in error, error
    assert snapshot(folder) == before


def test_resume_with_other_base_weights_is_refused(offline: Offline, tmp_path: Path) -> None:
    """The same model.path with other bytes (a LoRA run's adapters sit on those weights): refused,
    naming both hashes, the run left as it was."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from flows.config import load_config
    from flows.plan import open_run

    model = tmp_path / "base"
    shutil.copytree(offline.model, model)
    data = write_jsonl(tmp_path / "train.jsonl", good_rows())
    cfg = load_config(None, [f"model.path={model}", f"storage.root={offline.root}", "trainer.run_id=lora-base",
                             f"data.train_files=[{data}]", "actor.lora.rank=4"])
    run = open_run(cfg, "lora-base", resume=False)
    run.lease.release()
    recorded = json.loads((offline.root / "lora-base" / "run.json").read_text())["base_model"]
    assert recorded["path"] == str(model) and len(recorded["sha256"]) == 64
    weights = load_file(model / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + torch.finfo(torch.float32).eps  # one tensor, a tiny change
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    before = snapshot(offline.root / "lora-base")
    error, _ = offline.train(resume="lora-base")
    assert f"--resume lora-base: the base model at {model} is not the one the run began with" in error, error
    assert recorded["sha256"][:12] in error, error
    assert snapshot(offline.root / "lora-base") == before
