"""Learned reward models: a sequence classifier with one score that reads `prompt + response` as text.

The model is an `AutoModelForSequenceClassification` with `num_labels=1` (the score of the last real
token), loaded without dropout. It reads the conversation through its OWN tokenizer and chat template:
the prompt's messages plus the response as the assistant's turn, rendered and tokenized from text. The
policy's token ids are never reused, so a reward model with another vocabulary or template scores the
same conversation (verl's reward model worker does the same when the tokenizers differ). A rank runs it
through engine.workers.reward_model_worker.RewardModelScorer (sharded with FSDP2).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field

from engine.errors import ConfigError
from engine.models.loading import (
    ModelLoadError,
    first_line,
    hub_offline,
    torch_dtype,
    without_dropout,
    zero_dropout,
)

Prompt = str | list[dict[str, Any]]


class RewardModelSpec(BaseModel):
    """What a rank needs to load and run the reward model (from reward.model)."""

    path: str
    tokenizer_path: str | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False
    micro_batch_size: int = Field(32, gt=0)
    max_length: int = Field(512, gt=0)


def check_reward_model(path: str, trust_remote_code: bool = False) -> None:
    """ConfigError unless `path` holds a sequence classifier with one label (checked before launch)."""
    from transformers import AutoConfig

    local = hub_offline() or Path(path).expanduser().is_dir()
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=local)
    except (OSError, ValueError) as err:
        raise ConfigError(f"reward.model.path={path!r}: cannot read its config: {first_line(err)}") from err
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(f"reward.model.path={path!r} is {', '.join(archs) or 'a model without architectures'}, "
                          "not a sequence classifier: a reward model is an AutoModelForSequenceClassification "
                          "with num_labels=1 (one score per sequence)")
    if int(getattr(config, "num_labels", 0)) != 1:
        raise ConfigError(f"reward.model.path={path!r} has num_labels={config.num_labels}: a reward model "
                          "scores with one label")


def load_reward_model(spec: RewardModelSpec) -> Any:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    check_reward_model(spec.path, spec.trust_remote_code)
    local = hub_offline() or Path(spec.path).expanduser().is_dir()
    try:
        config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code,
                                            local_files_only=local)
        model = AutoModelForSequenceClassification.from_pretrained(
            spec.path, config=without_dropout(config), dtype=torch_dtype(spec.dtype),
            trust_remote_code=spec.trust_remote_code, local_files_only=local)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load the reward model from {spec.path!r}: {first_line(err)}") from err
    zero_dropout(model)
    model.requires_grad_(False)
    return model.eval()


def conversation_text(tokenizer: Any, prompt: Prompt, response: str) -> str:
    """The conversation as the reward model reads it: its chat template over the prompt's messages and
    the response as the assistant's turn; plain text (prompt, then response) without a template."""
    if isinstance(prompt, str):
        return prompt + response
    messages = [dict(m) for m in prompt] + [{"role": "assistant", "content": response}]
    if tokenizer.chat_template:
        return str(tokenizer.apply_chat_template(messages, tokenize=False))
    return "\n".join(m["content"] for m in messages)


def encode_conversations(tokenizer: Any, texts: Sequence[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, L], right padded; a text over `max_length` tokens keeps its last
    ones (the response and the end of the prompt are what the score reads)."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][-max_length:] for t in texts]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return input_ids, mask


def sequence_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] the score at each row's last real token (right padded rows)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, L, 1] or [B, 1]
    if logits.dim() == 2:
        return logits[:, 0].float()
    last = attention_mask.sum(-1) - 1
    return logits[torch.arange(len(last)), last, 0].float()


def prompts_of(column: Sequence[str]) -> list[Prompt]:
    """Prompts as they travel in a Batch column: JSON text (a chat's messages, or a plain string)."""
    return [json.loads(p) for p in column]
