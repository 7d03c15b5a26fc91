"""DPO's data: preference pairs, and the rows they train as.

One row, as TRL's DPO trainer reads it (parquet, jsonl, json or a `datasets` directory):

    {"prompt": [{"role": "user", "content": "..."}],                  # or a string: one user turn
     "chosen": [{"role": "assistant", "content": "..."}],             # or a string: one assistant turn
     "rejected": [{"role": "assistant", "content": "..."}],
     "data_source": "my/prefs"}                                       # optional

Each pair is one training row holding both responses: the chosen one in the columns a rollout's row has
(`input_ids`, `attention_mask`, `responses`, `response_mask`), the rejected one in the same columns
prefixed `rejected_` (`rejected_view`), so that every split of the rows (ranks, mini-batches,
micro-batches) keeps a pair together. The trained tokens are the response's assistant turns as the chat
template writes them (engine.data.conversations), never the prompt's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.batch import Batch
from engine.data.conversations import encode_conversation, load_rows, training_rows
from engine.data.prompts import PromptDataset, PromptRow, _short, _validate_prompt
from engine.errors import DataError

REJECTED = "rejected_"
SEQUENCE_COLUMNS = ("input_ids", "attention_mask", "responses", "response_mask")
PAIR_COLUMNS = (*SEQUENCE_COLUMNS, *(REJECTED + c for c in SEQUENCE_COLUMNS))


def load_preferences(files: Sequence[str], *, split: str, tokenizer: Any, max_length: int, truncation: str
                     ) -> PromptDataset:
    """Load and check `files`; each row's `prompt` is its prompt, its `extra_info` holds the `chosen` and
    `rejected` messages. A pair whose longer conversation is over `max_length` tokens is dropped with a
    count in the log (truncation "drop") or refused ("error")."""
    return load_rows(files, split=split, noun="preference pairs", row=_pair, max_length=max_length,
                     truncation=truncation, length=lambda r: max(len(ids) for ids, _ in _encoded(tokenizer, r)))


def _pair(record: Any, path: str, index: int) -> PromptRow:
    if not isinstance(record, dict):
        raise DataError(f"{path}: row {index}: expected an object with the keys 'prompt', 'chosen' and 'rejected', "
                        f"got {type(record).__name__}")

    def fail(key: str) -> Any:
        return lambda problem: DataError(f"{path}: row {index}: key {key!r}: {problem}")

    prompt = record.get("prompt")
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) and prompt else prompt
    messages = _validate_prompt(prompt, fail("prompt"))
    if messages[-1]["role"] == "assistant":
        raise fail("prompt")("its last turn is the assistant's; a prompt ends where the response starts")
    responses = {}
    for key in ("chosen", "rejected"):
        value = record.get(key)
        if value is None:
            raise fail(key)("missing; DPO needs a chosen and a rejected response to each prompt")
        value = [{"role": "assistant", "content": value}] if isinstance(value, str) else value
        turns = _validate_prompt(value, fail(key))
        if not any(m["role"] == "assistant" for m in turns):
            raise fail(key)(f"no assistant turn in {_short(turns)}: the response is what trains")
        responses[key] = turns
    source = record.get("data_source", "preferences")
    if not isinstance(source, str) or not source:
        raise DataError(f"{path}: row {index}: key 'data_source': expected a non-empty string or nothing, got {source!r}")
    return PromptRow(messages, source, None, {"index": index, **responses}, None, origin=f"{path}:{index}")


def _encoded(tokenizer: Any, row: PromptRow) -> list[tuple[list[int], list[bool]]]:
    """(ids, trained) of the chosen and the rejected conversation: only the response's turns train."""
    return [encode_conversation(tokenizer, [*row.prompt, *row.extra_info[key]], row.origin, first=len(row.prompt))
            for key in ("chosen", "rejected")]


def preference_batch(tokenizer: Any, rows: Sequence[PromptRow], indices: Sequence[int]) -> Batch:
    """The pairs as training rows: the chosen response in a rollout's columns, the rejected one in the same
    columns prefixed `rejected_` (each side padded to its own widths), and row_index [B]."""
    pad = int(tokenizer.pad_token_id)
    encoded = [_encoded(tokenizer, row) for row in rows]
    chosen = training_rows([e[0] for e in encoded], pad)
    rejected = training_rows([e[1] for e in encoded], pad)
    return Batch({**chosen, **{REJECTED + k: v for k, v in rejected.items()},
                  "row_index": torch.tensor(list(indices), dtype=torch.long)}, {})


def rejected_view(batch: Batch) -> Batch:
    """The rejected responses of a pair batch in a rollout's columns (what a forward pass reads)."""
    return Batch({c: batch.tensors[REJECTED + c] for c in SEQUENCE_COLUMNS}, {})


def preference_pairs(rows: list[dict[str, Any]], chosen: Any, rejected: Any) -> list[dict[str, Any]]:
    """Prompt rows in verl's layout as preference pairs: `chosen(row)` and `rejected(row)` as the answers
    (the synthetic tasks' reference answer and a wrong one: engine.demo.data)."""
    return [{"prompt": row["prompt"], "chosen": chosen(row), "rejected": rejected(row), "data_source": row["data_source"]}
            for row in rows]

