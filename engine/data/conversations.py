"""Supervised fine-tuning data: chat conversations, and the rows they train as.

One row, as TRL's and verl's SFT trainers read it (parquet, jsonl, json or a `datasets` directory):

    {"messages": [{"role": "system", "content": "..."},        # optional
                  {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...],
     "data_source": "my/demos"}                                # optional

The loss is on the assistant turns only, as the model's chat template writes them: a token trains when
it starts inside the text the template renders for an assistant message (its content and whatever the
template closes the turn with, an end-of-turn token included), and nothing else does (the system and
user turns, the role headers the template writes before an assistant turn, padding). A conversation is
one training row in the layout of a rollout's: the tokens before its first trained token are the
"prompt" (left padded), the rest the "response" (right padded), and `response_mask` marks the trained
tokens, so the user turns after the first are holes in it as a multi-turn rollout's observations are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.batch import Batch
from engine.data.prompts import (
    FILE_KINDS,
    Message,
    PromptDataset,
    PromptRow,
    _read_records,
    _short,
    _validate_prompt,
    absolute_source,
)
from engine.errors import DataError

log = logging.getLogger("rlflow.data")

MESSAGES_KEY = "messages"
ROLES = ("system", "user", "assistant")


def load_conversations(files: Sequence[str], *, split: str, tokenizer: Any, max_length: int,
                       truncation: str) -> PromptDataset:
    """Load and check `files`; each row's `prompt` is its whole conversation. A conversation longer than
    `max_length` tokens (chat template applied) is dropped with a count in the log (truncation "drop")
    or refused ("error")."""
    return load_rows(files, split=split, noun="conversations", row=_conversation, max_length=max_length,
                     truncation=truncation, length=lambda r: len(encode_conversation(tokenizer, r.prompt, r.origin)[0]))


def load_rows(files: Sequence[str], *, split: str, noun: str, row: Callable[[Any, str, int], PromptRow],
              max_length: int, truncation: str, length: Callable[[PromptRow], int]) -> PromptDataset:
    """The rows of `files`, each checked by `row(record, path, index)`; a row whose `length` is over
    `max_length` tokens dropped with a count in the log (truncation "drop") or refused ("error")."""
    if not files:
        raise DataError(f"no {split} files given; expected one or more {FILE_KINDS}")
    rows: list[PromptRow] = []
    for path in files:
        records = _read_records(str(path))
        if not records:
            raise DataError(f"{path}: the file has no rows; expected {noun}")
        rows.extend(row(record, str(path), i) for i, record in enumerate(records))
    kept = []
    for found in rows:
        n = length(found)
        if n <= max_length:
            kept.append(found)
        elif truncation == "error":
            raise DataError(f"{split} row {found.origin} has {n} tokens, over data.max_length={max_length} "
                            "(data.truncation=error); raise the limit, or set data.truncation=drop")
    if not kept:
        raise DataError(f"every one of the {len(rows)} {split} {noun} in {', '.join(map(str, files))} is longer "
                        f"than data.max_length={max_length} tokens; raise data.max_length or use shorter ones")
    if len(kept) < len(rows):
        log.warning("dropped %d of %d %s %s longer than data.max_length=%d tokens", len(rows) - len(kept), len(rows),
                    split, noun, max_length)
    return PromptDataset(kept, [absolute_source(p) for p in files], split)


def _conversation(record: Any, path: str, index: int) -> PromptRow:
    if not isinstance(record, dict):
        raise DataError(f"{path}: row {index}: expected an object with the key {MESSAGES_KEY!r} (a list of chat "
                        f"messages), got {type(record).__name__}")

    def fail(problem: str) -> DataError:
        return DataError(f"{path}: row {index}: key {MESSAGES_KEY!r}: {problem}")

    messages = _validate_prompt(record.get(MESSAGES_KEY), fail)
    for j, message in enumerate(messages):
        if message["role"] not in ROLES:
            raise fail(f"message {j} has the role {message['role']!r}; SFT conversations have {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise fail(f"no assistant turn in {_short(messages)}: SFT trains on the assistant's turns only, so a "
                   "conversation needs at least one")
    source = record.get("data_source", "sft")
    if not isinstance(source, str) or not source:
        raise DataError(f"{path}: row {index}: key 'data_source': expected a non-empty string or nothing, got {source!r}")
    return PromptRow(messages, source, None, {"index": index}, None, origin=f"{path}:{index}")


def _render(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))


def assistant_spans(tokenizer: Any, messages: list[Message], origin: str = "", first: int = 0
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as the chat template writes it, and the character span of each assistant turn
    from message `first` on: from the end of the text rendered up to it with the generation prompt, to the
    end of the text rendered through it. The template must write a conversation as the prefix of its
    continuation (every chat template of a causal model does); one that does not is refused, naming the row."""
    text = _render(tokenizer, messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < first:
            continue
        before, through = _render(tokenizer, messages[:i], True) if i else "", _render(tokenizer, messages[: i + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(f"row {origin}: the chat template does not write the conversation up to message {i} as the "
                            "start of the whole conversation, so its assistant tokens cannot be found; SFT needs a "
                            "template that only appends")
        spans.append((len(before), len(through)))
    return text, spans


def encode_conversation(tokenizer: Any, messages: list[Message], origin: str = "", first: int = 0
                        ) -> tuple[list[int], list[bool]]:
    """The conversation's token ids (chat template applied) and which of them train: a token trains when
    its first character is in the span of an assistant turn from message `first` on (`assistant_spans`)."""
    text, spans = assistant_spans(tokenizer, messages, origin, first)
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("SFT finds the assistant's tokens by their character offsets, which only a fast tokenizer "
                        f"gives; {type(tokenizer).__name__} is not one")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    trained = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    if not any(trained):
        raise DataError(f"row {origin}: no token of its assistant turns is left after tokenizing (empty turns?)")
    if trained[0]:
        raise DataError(f"row {origin}: the conversation starts with a trained token; SFT needs at least one token "
                        "before the first assistant token (the chat template's header)")
    return ids, trained


def sft_batch(tokenizer: Any, rows: Sequence[PromptRow], indices: Sequence[int]) -> Batch:
    """The rows as training rows in a rollout's layout: input_ids and attention_mask [B, P+T] (the part
    before the first trained token left padded to P, the rest right padded to T), responses and
    response_mask [B, T] (1 on the trained tokens), row_index [B]."""
    encoded = [encode_conversation(tokenizer, row.prompt, row.origin) for row in rows]
    return Batch({**training_rows(encoded, int(tokenizer.pad_token_id)),
                  "row_index": torch.tensor(list(indices), dtype=torch.long)}, {})


def training_rows(encoded: Sequence[tuple[list[int], list[bool]]], pad: int) -> dict[str, torch.Tensor]:
    """(ids, trained) of each row -> input_ids, attention_mask, responses, response_mask as `sft_batch` lays
    them out."""
    heads, tails, masks = [], [], []
    for ids, trained in encoded:
        first = trained.index(True)
        heads.append(ids[:first])
        tails.append(ids[first:])
        masks.append(trained[first:])
    p, t = max(map(len, heads)), max(map(len, tails))
    b = len(encoded)
    prompt = torch.full((b, p), pad, dtype=torch.long)
    prompt_mask = torch.zeros((b, p), dtype=torch.long)
    responses = torch.full((b, t), pad, dtype=torch.long)
    real = torch.zeros((b, t), dtype=torch.long)
    response_mask = torch.zeros((b, t), dtype=torch.long)
    for r, (head, tail, mask) in enumerate(zip(heads, tails, masks)):
        prompt[r, p - len(head):] = torch.tensor(head)
        prompt_mask[r, p - len(head):] = 1
        responses[r, : len(tail)] = torch.tensor(tail)
        real[r, : len(tail)] = 1
        response_mask[r, : len(tail)] = torch.tensor(mask, dtype=torch.long)
    return {"input_ids": torch.cat([prompt, responses], dim=1), "attention_mask": torch.cat([prompt_mask, real], dim=1),
            "responses": responses, "response_mask": response_mask}


def demonstrations(rows: list[dict[str, Any]], solution: Any) -> list[dict[str, Any]]:
    """Prompt rows in verl's layout as SFT conversations: the prompt, then `solution(row)` as the
    assistant's turn (the synthetic tasks' reference answers: engine.demo.data)."""
    return [{"messages": [*row["prompt"], {"role": "assistant", "content": solution(row)}],
             "data_source": row["data_source"]} for row in rows]

