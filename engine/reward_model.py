"""Learned reward models: a sequence classifier with one score that reads `prompt + response` as text.

    scorer = RewardModelScorer(RewardModelSpec(path="runs/tiny-rm"))   # in a rank: sharded with FSDP2
    scores = scorer.score(prompts, responses)                          # [B] float32

The model is an `AutoModelForSequenceClassification` with `num_labels=1` (the score of the last real
token), loaded without dropout. It reads the conversation through its OWN tokenizer and chat template:
the prompt's messages plus the response as the assistant's turn, rendered and tokenized from text. The
policy's token ids are never reused, so a reward model with another vocabulary or template scores the
same conversation (verl's reward model worker does the same when the tokenizers differ).

`build_tiny_rm` makes the project's own tiny reward model from the tiny sort policy, as reward models
are made from an SFT model: for the sort task, trained with a Bradley-Terry loss on preference pairs in
which the response that puts more digits in their sorted place is preferred (pairs of the policy's own
samples and synthetic candidates). Deterministic: the same (task, seed, steps) gives the same weights on
one machine.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import string
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

from engine.errors import ConfigError, RLFlowError
from engine.models.loading import (
    ModelLoadError,
    first_line,
    hub_offline,
    load_tokenizer,
    torch_dtype,
    without_dropout,
    zero_dropout,
)
from engine.rewards.rules import sort_score
from engine.synthetic import make_rows

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


class RewardModelScorer:
    """The reward model in one rank, sharded with FSDP2 over the rank's process group."""

    def __init__(self, spec: RewardModelSpec) -> None:
        from engine.workers import fsdp

        self.spec = spec
        self.tokenizer = load_tokenizer(spec.tokenizer_path or spec.path, trust_remote_code=spec.trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            raise ConfigError(f"the reward model's tokenizer ({spec.tokenizer_path or spec.path}) has no pad token")
        self.model = fsdp.shard_model(load_reward_model(spec))

    @torch.no_grad()
    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> torch.Tensor:
        """[B] scores of this rank's rows. Every rank runs as many forwards as the rank with the most
        micro-batches (each forward all-gathers the shards); a rank short of rows runs a dummy one."""
        from engine.workers import fsdp

        texts = [conversation_text(self.tokenizer, p, r) for p, r in zip(prompts, responses)]
        size = self.spec.micro_batch_size
        count = int(fsdp.global_max(float(math.ceil(len(texts) / size))))
        out = []
        for i in range(count):
            chunk = texts[i * size:(i + 1) * size]
            ids, mask = encode_conversations(self.tokenizer, chunk or ["."], self.spec.max_length)
            scores = sequence_scores(self.model, ids, mask)
            if chunk:
                out.append(scores)
        return torch.cat(out) if out else torch.zeros(0)


def prompts_of(column: Sequence[str]) -> list[Prompt]:
    """Prompts as they travel in a Batch column: JSON text (a chat's messages, or a plain string)."""
    return [json.loads(p) for p in column]


# ---------------------------------------------------------------------------------------------------
# the project's tiny reward model

RM_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n"
               "{% elif m['role'] == 'assistant' %}A: {{ m['content'] }}{% endif %}{% endfor %}")
RM_STEPS, RM_BATCH, RM_LR = 300, 64, 1e-3
RM_REPORT = "rlflow_tiny_rm.json"


@dataclass
class TinyRMReport:
    task: str
    seed: int
    steps: int
    held_out_pair_accuracy: float
    held_out_pairs: int
    build_seconds: float
    num_parameters: int


JUNK = string.ascii_letters + string.punctuation + " "


def _junk(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(JUNK) for _ in range(n))


def candidate_response(rng: random.Random, prompt_digits: str, truth: str) -> str:
    """A response to a sort prompt as a policy may write one: the answer with some digits wrong, the
    prompt's digits in another order, a wrong length, characters that are not digits (the first thing a
    policy trained against the model tries), or no `#### ` marker."""
    kind = rng.random()
    if kind < 0.2:  # characters that are not digits, alone, after the answer or in it
        answer = list(truth)
        for i in rng.sample(range(len(answer)), rng.randint(0, len(answer))):
            answer[i] = _junk(rng, 1)
        text = rng.choice(["".join(answer), "".join(answer) + _junk(rng, rng.randint(1, 10)),
                           _junk(rng, rng.randint(1, 14))])
        return text if rng.random() < 0.2 else f"#### {text}"
    if kind < 0.55:  # the sorted answer with k positions replaced
        answer = list(truth)
        for i in rng.sample(range(len(answer)), rng.randint(0, len(answer))):
            answer[i] = str(rng.randrange(10))
        text = "".join(answer)
    elif kind < 0.7:  # the prompt's digits, partly sorted
        digits = list(prompt_digits)
        cut = rng.randint(0, len(digits))
        text = "".join(sorted(digits[:cut]) + digits[cut:])
    elif kind < 0.85:  # a wrong length
        text = truth[: rng.randint(0, len(truth))] + "".join(str(rng.randrange(10)) for _ in range(rng.randint(0, 2)))
    else:  # random digits
        text = "".join(str(rng.randrange(10)) for _ in range(rng.randint(1, 7)))
    return text if rng.random() < 0.1 else f"#### {text}"


def policy_samples(policy: Any, tokenizer: Any, rows: list[dict[str, Any]], n: int, max_new_tokens: int = 16
                   ) -> list[list[str]]:
    """`n` sampled responses (temperature 1) of the policy to each row's prompt, as text."""
    from engine.models.tokens import decode_responses, encode_prompts

    out = []
    for start in range(0, len(rows), 128):
        chunk = rows[start:start + 128]
        enc = encode_prompts(tokenizer, [r["prompt"] for r in chunk])
        ids = policy.generate(input_ids=enc.input_ids.repeat_interleave(n, 0),
                              attention_mask=enc.attention_mask.repeat_interleave(n, 0), max_new_tokens=max_new_tokens,
                              do_sample=True, temperature=1.0, top_k=0, top_p=1.0, use_cache=True,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = decode_responses(tokenizer, ids[:, enc.input_ids.shape[1]:])
        out += [texts[k * n:(k + 1) * n] for k in range(len(chunk))]
    return out


def preference_pairs(task: str, n: int, seed: int, split: str, samples: list[list[str]] | None = None
                     ) -> list[tuple[list[dict[str, Any]], str, str]]:
    """`n` (prompt messages, chosen, rejected) pairs; chosen has the higher sort score. Each pair takes its
    two responses from the row's `samples` (the policy's own, when given) and synthetic candidates
    (`candidate_response`), so the model ranks what the policy writes and what it may drift to."""
    if task != "sort":
        raise ConfigError(f"make-tiny-rm builds a reward model for the sort task only, got task={task!r}")
    rng = random.Random(f"rlflow.tiny_rm/{split}/{seed}")
    pairs = []
    rows = make_rows(task, n, seed, split=f"rm-{split}")
    for k, row in enumerate(rows):
        truth = row["reward_model"]["ground_truth"]
        digits = row["prompt"][0]["content"].removeprefix("sort ").removesuffix(":")
        own = samples[k] if samples is not None else []
        for _ in range(100):
            a, b = (rng.choice(own) if own and rng.random() < 0.6 else candidate_response(rng, digits, truth)
                    for _ in range(2))
            sa, sb = sort_score("sort", a, truth), sort_score("sort", b, truth)
            if sa != sb:
                pairs.append((row["prompt"], a, b) if sa > sb else (row["prompt"], b, a))
                break
    return pairs


def build_tiny_rm(out_dir: str | Path, task: str = "sort", seed: int = 0, steps: int = RM_STEPS) -> TinyRMReport:
    """Train the tiny reward model into `out_dir` (absent or empty), the way reward models are made from an
    SFT model: the tiny sort policy's trunk (engine.tiny, built or taken from the cache) with a new score
    head (LlamaForSequenceClassification), its tokenizer with the reward model's own chat template
    ("Q: ...\nA: ..."), a Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) on `steps` batches of
    pairs drawn from the policy's own samples and synthetic candidates."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from engine.models.loading import load_model
    from engine.tiny import (
        BUILD_THREADS,
        _portable_tokenizer_class,
        _readable,
        cached_tiny,
        deterministic_cpu,
    )

    if steps < 0:
        raise ConfigError(f"steps must be >= 0, got {steps}")
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RLFlowError(f"{out} already exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    policy_dir = cached_tiny(task, seed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with deterministic_cpu(BUILD_THREADS):
            torch.manual_seed(seed)
            tokenizer = load_tokenizer(str(policy_dir))
            policy = load_model(str(policy_dir))
            train_rows = make_rows(task, steps * RM_BATCH, seed, split="rm-train")
            samples = policy_samples(policy, tokenizer, train_rows, 4)
            val_samples = policy_samples(policy, tokenizer, make_rows(task, 512, seed, split="rm-val"), 4)
            tokenizer.chat_template = RM_TEMPLATE
            base = {k: v for k, v in policy.config.to_dict().items() if k not in ("id2label", "label2id")}
            config = LlamaConfig(**{**base, "num_labels": 1, "architectures": None})
            model = LlamaForSequenceClassification(config)
            model.model.load_state_dict(policy.model.state_dict())  # the trunk; the score head is new
            del policy
            _train_bradley_terry(model, tokenizer, preference_pairs(task, steps * RM_BATCH, seed, "train", samples),
                                 steps)
            held_out = preference_pairs(task, 512, seed, "val", val_samples)
            accuracy = pair_accuracy(model, tokenizer, held_out)
        model.config.architectures = ["LlamaForSequenceClassification"]
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_class(tmp)
        report = TinyRMReport(task=task, seed=seed, steps=steps, held_out_pair_accuracy=round(accuracy, 4),
                              held_out_pairs=len(held_out), build_seconds=round(time.perf_counter() - started, 2),
                              num_parameters=sum(p.numel() for p in model.parameters()))
        (tmp / RM_REPORT).write_text(json.dumps(asdict(report), indent=2) + "\n")
        _readable(tmp)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _pair_scores(model: Any, tokenizer: Any, pairs: Sequence[tuple[Any, str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    texts = [conversation_text(tokenizer, p, c) for p, c, _ in pairs] + \
            [conversation_text(tokenizer, p, r) for p, _, r in pairs]
    ids, mask = encode_conversations(tokenizer, texts, 256)
    scores = sequence_scores(model, ids, mask)
    return scores[: len(pairs)], scores[len(pairs):]


def _train_bradley_terry(model: Any, tokenizer: Any, pairs: list[tuple[Any, str, str]], steps: int) -> None:
    optim = torch.optim.AdamW(model.parameters(), lr=RM_LR, weight_decay=0.0)
    model.train()
    for step in range(steps):
        for group in optim.param_groups:  # linear decay to 10 %
            group["lr"] = RM_LR * (1 - 0.9 * step / max(1, steps))
        chosen, rejected = _pair_scores(model, tokenizer, pairs[step * RM_BATCH:(step + 1) * RM_BATCH])
        loss = -F.logsigmoid(chosen - rejected).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
    model.eval()


@torch.no_grad()
def pair_accuracy(model: Any, tokenizer: Any, pairs: Sequence[tuple[Any, str, str]]) -> float:
    """The share of pairs whose chosen response scores higher."""
    chosen, rejected = _pair_scores(model, tokenizer, pairs)
    return float((chosen > rejected).float().mean())
