"""The self-built tiny model: reproducible weights, atomic builds, plain Hugging Face loading."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.demo import tiny
from engine.demo.tiny import (
    TinyReport,
    build_tiny,
    exact_answer_rate,
    final_answer,
    is_correct,
    read_report,
    weights_sha256,
)
from engine.errors import ConfigError, RLFlowError
from flows.commands import model as model_command


def _run_cli(argv: list[str]) -> int:
    # Only this command group: the test does not depend on the other groups importing cleanly.
    parser = argparse.ArgumentParser(prog="rlflow")
    model_command.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def test_same_seed_same_weights_other_seed_differs(
    quick_tiny: tuple[Path, TinyReport], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, first = quick_tiny
    again = tmp_path / "again"
    argv = ["model", "make-tiny", str(again), "--task", "arith", "--seed", "0", "--steps", str(first.steps)]
    assert _run_cli(argv) == 0
    assert first.weights_sha256 in capsys.readouterr().out
    assert read_report(again).weights_sha256 == first.weights_sha256
    other = build_tiny(tmp_path / "other", task="arith", seed=1, steps=first.steps)
    assert other.weights_sha256 != first.weights_sha256


def test_report_describes_the_saved_weights(quick_tiny: tuple[Path, TinyReport]) -> None:
    out, report = quick_tiny
    on_disk = json.loads((out / tiny.REPORT_FILE).read_text())
    assert on_disk["task"] == "arith" and on_disk["seed"] == 0 and on_disk["steps"] == report.steps
    assert on_disk["builder_digest"] == tiny.builder_digest()
    assert on_disk["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert on_disk["build_seconds"] > 0
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert weights_sha256(reloaded) == report.weights_sha256
    # the rate the build reports is the saved model's: evaluated again from the files, the same share
    assert on_disk["val_exact_answer_rate"] == report.val_exact_answer_rate == exact_answer_rate(out, "arith")


def test_loads_with_plain_auto_classes_and_generates(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.model_type == "llama"
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == tiny.PAD
    chats = [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "123+456="}]]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    enc = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 2 and 0 < out.shape[1] - enc["input_ids"].shape[1] <= 5


def test_chat_template_and_character_tokens(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+345="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<s><|user|>12+345=<|assistant|>"
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert tokens == ["<s>", "<|user|>", *"12+345=", "<|assistant|>"]  # one token per character
    history = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "#### 2"}]
    assert tokenizer.apply_chat_template(history, tokenize=False) == "<s><|user|>1+1=<|assistant|>#### 2</s>"
    assert tokenizer.decode(tokenizer("sort 312:\n", add_special_tokens=False)["input_ids"]) == "sort 312:\n"


@pytest.mark.parametrize("task", ["sort", "countdown"])
def test_other_tasks_build_and_evaluate(tmp_path: Path, task: str) -> None:
    report = build_tiny(tmp_path / task, task=task, seed=0, steps=2)
    assert report.task == task
    rate = exact_answer_rate(tmp_path / task, task, n=8, seed=0)
    # by hand: each of the 8 val rows alone (no padding), plain greedy generate, the task's own check
    from engine.demo.synthetic import make_rows

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / task)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / task).eval()
    right = 0
    for row in make_rows(task, 8, 0, split="val"):
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(input_ids=ids, max_new_tokens=tiny.MAX_NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        tokens = out[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in tokens:  # the response ends at its eos
            tokens = tokens[:tokens.index(tokenizer.eos_token_id)]
        response = tokenizer.decode(tokens)
        right += is_correct(task, response, row["reward_model"]["ground_truth"])
    assert rate == right / 8


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(tiny, "warm_start", crash)
    with pytest.raises(RuntimeError, match="mid-build"):
        build_tiny(tmp_path / "half", steps=1)
    assert list(tmp_path.iterdir()) == []


def test_refuses_a_full_directory_and_bad_input(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(RLFlowError, match="not an empty directory"):
        build_tiny(tmp_path / "full", steps=1)
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        build_tiny(tmp_path / "t", task="nope", steps=1)
    with pytest.raises(ConfigError, match="steps"):
        build_tiny(tmp_path / "t", steps=-1)


def test_build_restores_torch_state(tmp_path: Path) -> None:
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny(tmp_path / "m", steps=1)
    assert torch.equal(torch.rand(3), expected)  # the build used a private RNG
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == deterministic


def test_final_answer_and_correctness() -> None:
    assert final_answer("#### 357") == "357"
    assert final_answer("work... ####  42 trailing") == "42"
    assert final_answer("357") is None
    assert is_correct("arith", "#### 357", "357") and not is_correct("arith", "#### 35", "357")
    truth = json.dumps({"target": 14, "numbers": [2, 3, 4]})
    assert is_correct("countdown", "#### 2+3*4", truth) and is_correct("countdown", "#### 4*3+2", truth)
    for wrong in ("#### (2+3)*4", "#### 2+12", "#### 2+3+4", "#### 2**3", '#### __import__("os")', "14"):
        assert not is_correct("countdown", wrong, truth), wrong


def test_a_build_says_how_far_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A build in a process of its own (other CPU kernels) reports its phases through its parent: a line as
    each phase starts, at every tenth and at its end (plain lines: no terminal here)."""
    from engine.cpu_kernels import kernel_env
    from flows.progress import build_progress

    kernels = kernel_env("native")
    with build_progress(live=False):
        tiny.build_in_subprocess(tmp_path / "m", "sort", 0, kernels, steps=3)
    lines = capsys.readouterr().out.splitlines()
    warm = [line for line in lines if line.startswith("rlflow: tiny sort model: warm start ")]
    assert warm[0] == "rlflow: tiny sort model: warm start 0/3"
    assert [line.split()[6].rstrip(",") for line in warm] == ["0/3", "1/3", "2/3", "3/3"]
    evaluation = [line for line in lines if line.startswith("rlflow: tiny sort model: evaluation ")]
    assert evaluation[0] == "rlflow: tiny sort model: evaluation 0/256"
    assert evaluation[-1].startswith("rlflow: tiny sort model: evaluation 256/256, ")
    assert read_report(tmp_path / "m").steps == 3


def test_a_build_takes_one_thread_whatever_the_process_has() -> None:
    """The weights' bits depend on the thread count (1 and 2 threads differ on some CPUs: BENCHMARKS.md
    section 9), and the cache name and every resume assume one (task, seed) has one set of weights on every
    machine: a build in a process of 2 threads gives the bits of one thread."""
    import torch

    def warm(threads: int) -> str:
        with tiny.deterministic_cpu(threads):
            tokenizer = tiny.build_tokenizer()
            model = tiny.build_model(tokenizer, 0, tiny.SHAPE)
            tiny.warm_start(model, tokenizer, "arith", 0, 8)
        return weights_sha256(model)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.get_num_threads() == 2
        assert warm(tiny.BUILD_THREADS) == warm(1)
        assert torch.get_num_threads() == 2  # the process's own setting, back after the build
    finally:
        torch.set_num_threads(before)
