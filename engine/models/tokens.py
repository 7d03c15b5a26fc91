"""Prompts to tokens and responses to text, and what a forward pass over left-padded rows needs.

Prompts are chat messages in verl's layout (`[{"role": "user", "content": "12+345="}]`) or plain
strings. Chat prompts go through the tokenizer's chat template with `add_generation_prompt=True`;
a tokenizer without one gets the message contents joined by newlines. Batches are left padded, so
every prompt ends at the same column and generation continues from there.

Shapes: B prompts or responses, P prompt tokens (after padding), T response tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from engine.batch import Batch
from engine.models.loading import prepare_tokenizer

Message = dict[str, str]
Prompt = str | Sequence[Message]


@dataclass(frozen=True)
class EncodedPrompts:
    """Left-padded prompt tokens: `input_ids` (B, P) long, `attention_mask` (B, P) long, 0 on pads."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> str:
    """The text the model sees: the chat template (with the generation prompt) for chat messages, given the
    `tools` (OpenAI function schemas: multi-turn rollouts) when there are any; a template that has no
    place for tools leaves them out."""
    if isinstance(prompt, str):
        return prompt
    messages = [dict(m) for m in prompt]
    if tokenizer.chat_template:
        schemas: list[Any] | None = list(tools) if tools else None
        return str(tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,
                                                 add_generation_prompt=True))
    return "\n".join(m["content"] for m in messages)


def _token_ids(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt],
               tools: list[dict[str, Any]] | None = None) -> list[list[int]]:
    # A chat template writes its own special tokens (bos); the tokenizer adds them only to plain text.
    ids = []
    for prompt in prompts:
        chat = not isinstance(prompt, str) and bool(tokenizer.chat_template)
        text = prompt_text(tokenizer, prompt, tools)
        ids.append(tokenizer(text, add_special_tokens=not chat)["input_ids"])
    return ids


def prompt_lengths(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt],
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Tokens of each prompt as the model sees it (what `data.max_prompt_length` limits)."""
    return [len(ids) for ids in _token_ids(tokenizer, prompts, tools)]


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt], max_length: int | None = None,
                   truncation: str = "left", tools: list[dict[str, Any]] | None = None) -> EncodedPrompts:
    """Tokens of `prompts`, left padded with the tokenizer's pad id to the longest prompt. A prompt over
    `max_length` tokens is cut: truncation "left" keeps its last tokens (the end of the conversation and
    the generation prompt), "right" its first; any other truncation leaves it (the data layer dropped or
    refused it already)."""
    if tokenizer.pad_token_id is None:
        prepare_tokenizer(tokenizer)
    ids = _token_ids(tokenizer, prompts, tools)
    if max_length is not None and truncation == "left":
        ids = [seq[-max_length:] for seq in ids]
    elif max_length is not None and truncation == "right":
        ids = [seq[:max_length] for seq in ids]
    width = max((len(x) for x in ids), default=0)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, P)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)  # (B, P)
    for row, seq in enumerate(ids):
        if seq:
            input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, width - len(seq) :] = 1
    return EncodedPrompts(input_ids=input_ids, attention_mask=attention_mask)


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: each real token's index among its row's real tokens (pads 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def packed_inputs(batch: Batch, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' real tokens end to end, as one sequence: (input_ids [1, N], position_ids [1, N], index
    [B, keep] of the position whose logits predict each response token, clamped into the row).

    Each row contributes its prompt's real tokens and its first `keep` response columns that are real;
    position ids restart at 0 for every row, which is how transformers (masking_utils) recognises packed
    sequences and keeps attention within each row when no attention mask is given."""
    input_ids, t = batch.tensors["input_ids"], batch.tensors["responses"].shape[1]
    mask = batch.tensors["attention_mask"][:, : input_ids.shape[1] - t + keep].bool()  # [B, P+keep]
    ids = input_ids[:, : mask.shape[1]][mask]  # [N]
    lengths = mask.sum(-1)  # [B] real tokens of each row
    starts = lengths.cumsum(0) - lengths  # [B] where each row begins in the sequence
    pos = torch.arange(int(lengths.sum())) - starts.repeat_interleave(lengths)  # restarts at 0 per row
    prompt_len = mask.shape[1] - keep - (~mask[:, : mask.shape[1] - keep]).sum(-1)  # [B] real prompt tokens
    # response token j is predicted by the row's position prompt_len - 1 + j
    offset = (prompt_len - 1).unsqueeze(1) + torch.arange(keep).unsqueeze(0)  # [B, keep]
    index = starts.unsqueeze(1) + offset.clamp(max=(lengths - 1).unsqueeze(1))
    return ids.unsqueeze(0), pos.unsqueeze(0), index


def cache_argument(model: torch.nn.Module) -> str:
    """forward's KV-cache argument: transformers 5 renames `past_key_values` to `cache` (the old name
    warns, then goes)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None) -> set[int]:
    """Ids that end a response: the tokenizer's eos and the model's generation eos (one id or several)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model is not None:
        eos: Any = model.generation_config.eos_token_id
        ids.update(int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
    return ids


def response_texts(tokenizer: PreTrainedTokenizerBase, batch: Batch) -> list[str]:
    """The text a reward (and the validation score) reads of each response of `batch`.

    Single-turn: `decode_responses`, cut at the first stop token. Multi-turn (a `turns` column): every real
    token of the response in order, the model's turns and the observations between them, special tokens
    kept as they are; only a stop token that ends the whole response is left out. A turn's own end-of-turn
    token inside the response is not an end (Llama 3.1 ends every turn, a call included, with <|eot_id|>),
    and the pad token may be the end-of-turn token itself, so the real tokens come from the attention mask.
    """
    if "turns" not in batch:
        return decode_responses(tokenizer, batch["responses"])
    responses = batch.tensors["responses"]
    real = batch.tensors["attention_mask"][:, -responses.shape[1]:].bool()
    stops = stop_token_ids(tokenizer)
    texts = []
    for row, keep in zip(responses.tolist(), real.tolist()):
        ids = [int(t) for t, k in zip(row, keep) if k]
        if ids and ids[-1] in stops:
            ids = ids[:-1]
        texts.append(str(tokenizer.decode(ids, skip_special_tokens=False)))
    return texts


def decode_responses(
    tokenizer: PreTrainedTokenizerBase,
    response_ids: torch.Tensor | Sequence[Sequence[int]],
    *,
    stop_ids: Iterable[int] | None = None,
) -> list[str]:
    """Text of each response (B, T): cut at its first stop token (default eos), pad tokens dropped.

    Other special tokens stay in the text, so a reward sees exactly what the policy wrote.
    """
    stops = set(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id
    rows = response_ids.tolist() if isinstance(response_ids, torch.Tensor) else response_ids
    texts = []
    for row in rows:
        kept = []
        for tok in row:
            if tok in stops:
                break
            if tok != pad:
                kept.append(int(tok))
        texts.append(str(tokenizer.decode(kept, skip_special_tokens=False)))
    return texts
