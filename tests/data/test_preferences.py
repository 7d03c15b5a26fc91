"""DPO's data (engine/data/preferences.py): a pair is one row holding both responses, only the response's
tokens train (not an assistant turn of the prompt), and bad pairs are refused in one line naming the row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.data.preferences import load_preferences, preference_batch, rejected_view
from engine.demo import tiny
from engine.errors import DataError

PROMPT = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "#### 3"},
          {"role": "user", "content": "again"}]


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return tiny.build_tokenizer()


def _write(path: Path, rows: list[object]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_pair_is_one_row_and_only_its_responses_train(tok, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The prompt's own assistant turn ("#### 3") does not train; each side's response and its </s> do."""
    path = _write(tmp_path / "pairs.jsonl", [
        {"prompt": PROMPT, "chosen": "#### 2", "rejected": [{"role": "assistant", "content": "#### 22"}]},
        {"prompt": "2+2=", "chosen": "#### 4", "rejected": "#### 5"}])
    rows = load_preferences([path], split="train", tokenizer=tok, max_length=64, truncation="drop")
    assert rows[1].prompt == [{"role": "user", "content": "2+2="}]
    batch = preference_batch(tok, list(rows), [0, 1])
    rejected = rejected_view(batch)
    for side, want in ((batch, ["#### 2</s>", "#### 4</s>"]), (rejected, ["#### 22</s>", "#### 5</s>"])):
        for r in range(2):
            trained = side["responses"][r][side["response_mask"][r].bool()].tolist()
            assert tok.decode(trained) == want[r]
            ids = side["input_ids"][r][side["attention_mask"][r].bool()].tolist()
            assert tok.decode(ids).endswith(want[r])
    # the first row's prompt part holds the prompt's assistant turn, untrained
    prompt_part = batch["input_ids"][0, : batch["input_ids"].shape[1] - batch["responses"].shape[1]]
    assert "#### 3</s>" in tok.decode(prompt_part.tolist())
    assert batch["responses"].shape[1] == 7 and rejected["responses"].shape[1] == 8  # each side its own width
    assert torch.equal(batch["row_index"], torch.tensor([0, 1]))


@pytest.mark.parametrize(("row", "says"), [
    ({"prompt": "1+1=", "chosen": "#### 2"},
     "row 1: key 'rejected': missing; DPO needs a chosen and a rejected response to each prompt"),
    ({"prompt": "1+1=", "chosen": [{"role": "user", "content": "2"}], "rejected": "#### 3"},
     "row 1: key 'chosen': no assistant turn in [{'role': 'user', 'content': '2'}]: the response is what trains"),
    ({"prompt": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}], "chosen": "#### 2",
      "rejected": "#### 3"},
     "row 1: key 'prompt': its last turn is the assistant's; a prompt ends where the response starts"),
], ids=["no-rejected", "chosen-without-assistant", "prompt-ends-with-assistant"])
def test_a_bad_pair_is_one_line_naming_its_row(tok, tmp_path: Path, row: dict, says: str) -> None:  # type: ignore[no-untyped-def]
    path = _write(tmp_path / "pairs.jsonl", [{"prompt": "2+2=", "chosen": "#### 4", "rejected": "#### 5"}, row])
    with pytest.raises(DataError) as err:
        load_preferences([path], split="train", tokenizer=tok, max_length=64, truncation="drop")
    assert str(err.value) == f"{path}: {says}"
