"""SFT's data (engine/data/conversations.py): which tokens train, by hand, under the tiny model's chat
template and a Hub family's; the rows in a rollout's layout; bad conversations refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.data.conversations import encode_conversation, load_conversations, sft_batch
from engine.data.prompts import PromptRow
from engine.demo import tiny
from engine.errors import DataError

TWO_TURNS = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "#### 3"},
             {"role": "user", "content": "ok"}, {"role": "assistant", "content": "#### 4"}]


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return tiny.build_tokenizer()


def test_only_the_assistant_turns_train_under_the_tiny_template(tok) -> None:  # type: ignore[no-untyped-def]
    """The template writes <s><|user|>12<|assistant|>#### 3</s><|user|>ok<|assistant|>#### 4</s> (one
    token a character, a token each special): each assistant turn's content and its </s> train; the
    bos, the user turns and the <|assistant|> headers do not."""
    ids, trained = encode_conversation(tok, TWO_TURNS)
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens == ["<s>", "<|user|>", "1", "2", "<|assistant|>", "#", "#", "#", "#", " ", "3", "</s>",
                      "<|user|>", "o", "k", "<|assistant|>", "#", "#", "#", "#", " ", "4", "</s>"]
    assert trained == [False] * 5 + [True] * 7 + [False] * 4 + [True] * 7


def test_only_the_assistant_turns_train_under_a_hub_template() -> None:
    """A ChatML template (qwen2's: <|im_start|>role\\n ... <|im_end|>\\n), a system turn first: the trained
    text is each assistant turn's content through its <|im_end|> and the newline after it, exactly."""
    from engine.demo.families import FAMILIES, build_tokenizer, task_corpus

    tok = build_tokenizer(FAMILIES["qwen2"], task_corpus("arith", 0, rows=200))
    messages = [{"role": "system", "content": "be brief"}, *TWO_TURNS]
    ids, trained = encode_conversation(tok, messages)
    assert tok.decode([i for i, t in zip(ids, trained) if t]) == "#### 3<|im_end|>\n#### 4<|im_end|>\n"
    text = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ids) == text
    untrained = tok.decode([i for i, t in zip(ids, trained) if not t])
    assert untrained == text.replace("#### 3<|im_end|>\n", "").replace("#### 4<|im_end|>\n", "")


def test_rows_are_in_a_rollouts_layout(tok) -> None:  # type: ignore[no-untyped-def]
    """The part before the first trained token is the prompt, left padded; the rest the response, right
    padded; the trained tokens are response_mask, and the later user turn is a hole in it."""
    rows = [PromptRow(TWO_TURNS, "a", None), PromptRow([{"role": "user", "content": "7"},
                                                        {"role": "assistant", "content": "9"}], "b", None)]
    batch = sft_batch(tok, rows, [4, 2])
    assert batch["row_index"].tolist() == [4, 2]
    # prompts "<s><|user|>12<|assistant|>" (5 tokens) and "<s><|user|>7<|assistant|>" (4): one pad on the left
    assert batch["input_ids"].shape == (2, 5 + 18) and batch["responses"].shape == (2, 18)
    assert batch["attention_mask"][1, :1].tolist() == [0] and batch["attention_mask"][1, 1:5].tolist() == [1] * 4
    assert torch.equal(batch["input_ids"][:, 5:], batch["responses"])
    assert batch["response_mask"][0].tolist() == [1] * 7 + [0] * 4 + [1] * 7
    assert batch["response_mask"][1].tolist() == [1, 1] + [0] * 16  # "9</s>", then padding
    assert batch["attention_mask"][1, 5:].tolist() == [1, 1] + [0] * 16
    assert tok.decode(batch["responses"][1, :2].tolist()) == "9</s>"


def _write(path: Path, rows: list[object]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(("row", "says"), [
    ({"messages": [{"role": "user", "content": "hi"}]},
     "row 1: key 'messages': no assistant turn in [{'role': 'user', 'content': 'hi'}]: SFT trains on the "
     "assistant's turns only, so a conversation needs at least one"),
    ({"prompt": [{"role": "user", "content": "hi"}]},
     "row 1: key 'messages': missing; expected a non-empty list of chat messages {'role': str, 'content': str}"),
    ({"messages": [{"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]},
     "row 1: key 'messages': message 0 has the role 'tool'; SFT conversations have system, user, assistant"),
], ids=["no-assistant-turn", "no-messages", "tool-role"])
def test_a_bad_conversation_is_one_line_naming_its_row(tok, tmp_path: Path, row: dict, says: str) -> None:  # type: ignore[no-untyped-def]
    path = _write(tmp_path / "sft.jsonl", [{"messages": TWO_TURNS}, row])
    with pytest.raises(DataError) as err:
        load_conversations([path], split="train", tokenizer=tok, max_length=64, truncation="drop")
    assert str(err.value) == f"{path}: {says}"


def test_long_conversations_are_dropped_or_refused(tok, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    short = {"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]}  # 6 tokens
    path = _write(tmp_path / "sft.jsonl", [{"messages": TWO_TURNS}, short])  # 23 and 6 tokens
    kept = load_conversations([path], split="train", tokenizer=tok, max_length=22, truncation="drop")
    assert [r.prompt for r in kept] == [short["messages"]]
    with pytest.raises(DataError, match=r"^train row .*sft.jsonl:0 has 23 tokens, over data.max_length=22 "):
        load_conversations([path], split="train", tokenizer=tok, max_length=22, truncation="error")


def test_sources_are_absolute(tok, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A relative data file is named as the stage workers, in a working folder of their own, must open it."""
    _write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "1+1"},
                                                   {"role": "assistant", "content": "2"}]}])
    monkeypatch.chdir(tmp_path)
    chats = load_conversations(["chat.jsonl"], split="train", tokenizer=tok, max_length=64, truncation="drop")
    assert chats.sources == [str(tmp_path / "chat.jsonl")]
