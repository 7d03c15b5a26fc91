"""The project's own tiny reward model (`rlflow model make-tiny-rm`).

`build_tiny_rm` makes it from the tiny sort policy, as reward models are made from an SFT model: for the
sort task, trained with a Bradley-Terry loss on preference pairs in which the response that puts more
digits in their sorted place is preferred (pairs of the policy's own samples and synthetic candidates).
Deterministic: the same (task, seed, steps) gives the same weights on one machine.
"""

from __future__ import annotations

import json
import random
import string
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.demo.progress import report
from engine.demo.synthetic import make_rows
from engine.errors import ConfigError
from engine.models.loading import load_tokenizer
from engine.rewards.reward_model import conversation_text, encode_conversations, sequence_scores
from engine.rewards.rules import sort_score

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
        report("tiny reward model: the policy's samples", len(out), len(rows))
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
    SFT model: the tiny sort policy's trunk (engine.demo.tiny, built or taken from the cache) with a new score
    head (LlamaForSequenceClassification), its tokenizer with the reward model's own chat template
    ("Q: ...\nA: ..."), a Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) on `steps` batches of
    pairs drawn from the policy's own samples and synthetic candidates."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from engine.demo.folders import empty_target, into_place
    from engine.demo.tiny import BUILD_THREADS, cached_tiny, deterministic_cpu, portable_tokenizer_class
    from engine.models.loading import load_model

    if steps < 0:
        raise ConfigError(f"steps must be >= 0, got {steps}")
    out = empty_target(out_dir)
    started = time.perf_counter()
    policy_dir = cached_tiny(task, seed)
    with into_place(out) as tmp:
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
        portable_tokenizer_class(tmp)
        report = TinyRMReport(task=task, seed=seed, steps=steps, held_out_pair_accuracy=round(accuracy, 4),
                              held_out_pairs=len(held_out), build_seconds=round(time.perf_counter() - started, 2),
                              num_parameters=sum(p.numel() for p in model.parameters()))
        (tmp / RM_REPORT).write_text(json.dumps(asdict(report), indent=2) + "\n")
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
    report("tiny reward model: Bradley-Terry training", 0, steps)
    for step in range(steps):
        for group in optim.param_groups:  # linear decay to 10 %
            group["lr"] = RM_LR * (1 - 0.9 * step / max(1, steps))
        chosen, rejected = _pair_scores(model, tokenizer, pairs[step * RM_BATCH:(step + 1) * RM_BATCH])
        loss = -F.logsigmoid(chosen - rejected).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        report("tiny reward model: Bradley-Terry training", step + 1, steps)
    model.eval()


@torch.no_grad()
def pair_accuracy(model: Any, tokenizer: Any, pairs: Sequence[tuple[Any, str, str]]) -> float:
    """The share of pairs whose chosen response scores higher."""
    chosen, rejected = _pair_scores(model, tokenizer, pairs)
    return float((chosen > rejected).float().mean())
