"""The project's own tiny model: a character-level tokenizer and a small Llama, warm-started on a task.

No hub can be reached here, so the default run and the tests use a model the project builds itself:

- tokenizer: one token per printable ASCII character plus pad, bos, eos, unk and the chat role markers,
  built with `tokenizers` and wrapped as `PreTrainedTokenizerFast` with a chat template;
- model: `LlamaForCausalLM` (hidden 128, MLP 256, 4 layers, 4 heads, tied embeddings), 0.67 M parameters;
- warm start: supervised fine-tuning on the synthetic task (loss on response tokens only), stopped
  early on purpose so that greedy decoding is right sometimes, not always: RL has something to learn.

The same (task, seed, steps) gives the same weights on every machine with the same CPU kernels (AVX2 on
x86-64 by default, engine.cpu_kernels): every random draw is seeded, the data order is fixed, and the
build runs with a fixed number of torch threads and deterministic algorithms. `weights_sha256` in
`rlflow_tiny.json` is the check.

Shapes: B sequences, L tokens (prompt + response, right padded for training).
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import json
import math
import operator
import os
import re
import shutil
import string
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    GenerationConfig,
    GenerationMixin,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from engine.config import ModelConfig
from engine.cpu_kernels import kernel_tag, pinned_here, run_module_pinned
from engine.demo import progress
from engine.demo.folders import empty_target, into_place
from engine.demo.progress import report
from engine.demo.synthetic import GUESS_TURNS, TASKS, make_rows, solution_text
from engine.errors import ConfigError
from engine.models import loading
from engine.models.loading import cache_dir, load_model, load_tokenizer, source_digest
from engine.models.tokens import decode_responses, encode_prompts, prompt_text

# What a cached build's name carries of the code that made it: the builder's own source and the
# libraries' versions (engine.models.loading.source_digest), so an edited builder never reuses an old build.
BUILDER_FILES = ("tiny.py", "synthetic.py")
REPORT_FILE = "rlflow_tiny.json"

# The recipe. Steps per task are tuned so that greedy decoding is right about 10-50 % of the time on
# the val split (seeds 0/1/2 — arith: 19.9/11.7/18.8 %, sort: 47.7/25.4/12.5 %, countdown:
# 49.6/44.9/23.4 %). Sort is learned within ~100 steps and countdown jumps from 0 to ~40 % between
# 150 and 250 steps, so their warm starts stop early. Guess (GuessNumber in 4 turns, greedy success):
# 50 steps 0.30, 80 steps 0.77, 200 steps 0.96; 80, so that RL has room and a start (README).
DEFAULT_STEPS = {"arith": 800, "sort": 45, "countdown": 350, "calc": 600, "guess": 80}
FALLBACK_STEPS = 800  # a task added later without its own tuning
BATCH_SIZE = 64
LR = 3e-3
WARMUP_STEPS = 20
# Threads of a build: one. The weights' bits depend on the thread count, and how depends on the CPU: on
# one 2-core machine 1 and 2 threads gave the same bits, on another (a Xeon with AMX, 2026-12-05) they did
# not, with the AVX2 kernels pinned too (bench/build_threads.py, BENCHMARKS.md section 9). The cache and
# every resume rely on one task and seed giving the same bits on every machine, so a build takes one core.
BUILD_THREADS = 1
EVAL_ROWS = 256
EVAL_SEED = 0
MAX_NEW_TOKENS = 12  # "#### " + up to 6 characters + eos, with room to spare

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLES = ("system", "user", "assistant")
ROLE_TOKENS = [f"<|{role}|>" for role in ROLES]
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, *ROLE_TOKENS]
# Printable ASCII and newline: every character of the synthetic tasks, and of arithmetic expressions.
ALPHABET = [c for c in string.printable if c not in "\t\r\x0b\x0c"]

# <s><|user|>12+345=<|assistant|>#### 357</s>; an assistant turn in the history ends with eos.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyShape:
    """The model's size: about the benchmark's smallest (W1) shape."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    max_position_embeddings: int = 256


SHAPE = TinyShape()


@dataclass(frozen=True)
class TinyReport:
    """What `rlflow_tiny.json` holds."""

    task: str
    seed: int
    steps: int
    builder_digest: str
    cpu_capability: str  # the kernels torch ran the build with (engine.cpu_kernels)
    weights_sha256: str
    val_exact_answer_rate: float
    val_rows: int
    build_seconds: float
    num_parameters: int
    torch_version: str
    # sha256 of every other file of the folder, by name: what a cached build is checked against on each use
    files_sha256: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------
# tokenizer and model


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer: ids 0-6 are the special tokens, then one id per character."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ALPHABET)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    core.decoder = decoders.Fuse()  # join characters without spaces
    core.add_special_tokens(SPECIAL_TOKENS)
    # Plain text gets bos; chat prompts get it from the template (encoded without special tokens).
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=ROLE_TOKENS,
        padding_side="left",
        model_max_length=SHAPE.max_position_embeddings,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int, shape: TinyShape = SHAPE) -> LlamaForCausalLM:
    """A freshly initialised small Llama; the weights depend only on `seed` (seeds torch's global RNG)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        # 10000 is also the default of older transformers, which read `rope_theta`, not this.
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over (name, dtype, shape, bytes) of every state-dict tensor, in sorted key order."""
    digest = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------
# supervised warm start


def sft_batches(
    tokenizer: PreTrainedTokenizerFast, task: str, seed: int, steps: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`steps` batches of (input_ids, attention_mask, labels), each (B, L), right padded.

    Rows come from the task's own "sft" split, so they are neither the RL train nor the val prompts;
    labels are -100 everywhere but the response and its eos.
    """
    rows = make_rows(task, steps * BATCH_SIZE, seed, split="sft")
    spec = TASKS[task]
    for start in range(0, len(rows), BATCH_SIZE):
        seqs, labels = [], []
        for k, row in enumerate(rows[start : start + BATCH_SIZE]):
            prompt = tokenizer(prompt_text(tokenizer, row["prompt"]), add_special_tokens=False)["input_ids"]
            if spec.episode is not None:  # a game against an environment: the whole episode
                segments = spec.episode(row["reward_model"]["ground_truth"], start + k)
            elif spec.tool_solution is not None and k % 2 == 0:  # half the demonstrations call the task's tool
                segments = spec.tool_solution(row["prompt"][0]["content"], row["reward_model"]["ground_truth"])
            else:
                segments = [(solution_text(row), True)]
            response: list[int] = []
            label: list[int] = []
            for text, trained in segments:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                response += ids
                label += ids if trained else [-100] * len(ids)
            seqs.append(prompt + [*response, tokenizer.eos_token_id])
            labels.append([-100] * len(prompt) + [*label, tokenizer.eos_token_id])
        # Right padding keeps position ids 0..n-1 from the first real token, as in left-padded generate.
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, L)
        label_ids = torch.full((len(seqs), width), -100, dtype=torch.long)  # (B, L)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, L)
        for i, (seq, lab) in enumerate(zip(seqs, labels, strict=True)):
            input_ids[i, : len(seq)] = torch.tensor(seq)
            label_ids[i, : len(lab)] = torch.tensor(lab)
            mask[i, : len(seq)] = 1
        yield input_ids, mask, label_ids


def _lr_at(step: int, steps: int) -> float:
    # Linear warmup, then cosine to 10 % of the peak.
    if step < WARMUP_STEPS:
        return LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def warm_start(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, task: str, seed: int, steps: int
) -> None:
    """`steps` AdamW steps of next-token loss on the task's reference responses."""
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    report(f"tiny {task} model: warm start", 0, steps)
    for step, (input_ids, mask, labels) in enumerate(sft_batches(tokenizer, task, seed, steps)):
        for group in optim.param_groups:
            group["lr"] = _lr_at(step, steps)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        report(f"tiny {task} model: warm start", step + 1, steps)
    model.eval()


@contextlib.contextmanager
def deterministic_cpu(threads: int) -> Iterator[None]:
    """Fixed torch threads, deterministic algorithms and a private RNG; all restored afterwards."""
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(old_det, warn_only=old_warn)
        torch.set_num_threads(old_threads)


# ---------------------------------------------------------------------------------------------------
# evaluation


_ANSWER = re.compile(r"####\s*(\S+)")


def final_answer(response: str) -> str | None:
    """The answer after the first `####`, or None."""
    found = _ANSWER.search(response)
    return found.group(1) if found else None


def is_correct(task: str, response: str, ground_truth: str) -> bool:
    """The `#### answer` equals the ground truth; for countdown, the expression reaches the target
    using each given number exactly once (the ground truth is `{"target": .., "numbers": [..]}`)."""
    answer = final_answer(response)
    if answer is None:
        return False
    if task == "countdown":
        spec = json.loads(ground_truth)
        return _reaches(answer, spec["target"], spec["numbers"])
    return answer == ground_truth


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _reaches(expression: str, target: int, numbers: list[int]) -> bool:
    # Walks the syntax tree of + - * on integer literals: nothing generated is ever executed.
    used: list[int] = []

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("not + - * on integers")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError):
        return False
    return result == target and sorted(used) == sorted(numbers)


@torch.no_grad()
def exact_answer_rate(
    model_dir: str | Path,
    task: str,
    n: int = EVAL_ROWS,
    seed: int = EVAL_SEED,
    *,
    batch_size: int = 128,
    model: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> float:
    """Share of `n` val rows of `task` whose greedy response is right (`is_correct`).

    Loads the model and tokenizer from `model_dir` unless they are given (the build passes its own).
    """
    tokenizer = tokenizer or load_tokenizer(str(model_dir))
    model = model or load_model(str(model_dir))
    assert isinstance(model, GenerationMixin), f"{type(model).__name__} cannot generate"
    rows = make_rows(task, n, seed, split="val")
    if task == "guess":
        return guess_success_rate(model, tokenizer, rows)
    correct = 0
    report(f"tiny {task} model: evaluation", 0, n)
    for start in range(0, n, batch_size):
        chunk = rows[start : start + batch_size]
        enc = encode_prompts(tokenizer, [row["prompt"] for row in chunk])
        out = model.generate(  # type: ignore[misc]  # transformers 5.19's stub of generate's self type
            input_ids=enc.input_ids,
            attention_mask=enc.attention_mask,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            use_cache=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        responses = decode_responses(tokenizer, out[:, enc.input_ids.shape[1] :])  # (B, T) -> B texts
        for row, response in zip(chunk, responses, strict=True):
            correct += is_correct(task, response, row["reward_model"]["ground_truth"])
        report(f"tiny {task} model: evaluation", start + len(chunk), n)
    return correct / n if n else 0.0


def guess_success_rate(model: Any, tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]]) -> float:
    """Share of GuessNumber episodes (engine.rollout.builtin_envs, played here in-process, greedy) that find
    the row's secret within GUESS_TURNS turns: the warm start's "before" of configs/tiny_guess.yaml."""
    from engine.rollout.builtin_envs import GuessNumber

    found = 0
    report("tiny guess model: evaluation", 0, len(rows))
    for i, row in enumerate(rows):
        env = GuessNumber()
        messages = env.init({"ground_truth": row["reward_model"]["ground_truth"]})
        ids = tokenizer(prompt_text(tokenizer, messages), add_special_tokens=False)["input_ids"]
        for _ in range(GUESS_TURNS):
            out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_NEW_TOKENS, do_sample=False, use_cache=True,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            turn = out[0, len(ids):].tolist()
            observations, reward, done, _ = env.step(str(tokenizer.decode(turn, skip_special_tokens=True)))
            if done:
                found += reward > 0
                break
            hint = "".join(f"<|{m['role']}|>{m['content']}" for m in observations) + "<|assistant|>"
            if not turn or turn[-1] != tokenizer.eos_token_id:  # cut at the length: the template ends the turn
                hint = EOS + hint
            ids = ids + turn + tokenizer(hint, add_special_tokens=False)["input_ids"]
        report("tiny guess model: evaluation", i + 1, len(rows))
    return found / len(rows) if rows else 0.0


# ---------------------------------------------------------------------------------------------------
# building


def default_steps(task: str) -> int:
    return DEFAULT_STEPS.get(task, FALLBACK_STEPS)


def build_tiny(
    out_dir: str | Path, task: str = "arith", seed: int = 0, steps: int | None = None, shape: TinyShape = SHAPE
) -> TinyReport:
    """Build the tiny model for `task` into `out_dir` (which must not exist or be empty).

    `shape` other than the default is for benchmarks (bench/): the cached `model.path: tiny` is SHAPE.

    Written into a temporary sibling directory and renamed into place at the end: `out_dir` either
    holds a complete model, with `rlflow_tiny.json` written last, or nothing.
    """
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    steps = default_steps(task) if steps is None else steps
    if steps < 0:
        raise ConfigError(f"steps must be >= 0, got {steps}")
    with into_place(empty_target(out_dir)) as tmp:
        return _build_into(tmp, task, seed, steps, shape)


def _build_into(directory: Path, task: str, seed: int, steps: int, shape: TinyShape) -> TinyReport:
    started = time.perf_counter()
    with deterministic_cpu(BUILD_THREADS):
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed, shape)
        warm_start(model, tokenizer, task, seed, steps)
        digest = weights_sha256(model)
        rate = exact_answer_rate(directory, task, model=model, tokenizer=tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    portable_tokenizer_class(directory)
    report = TinyReport(
        task=task,
        seed=seed,
        steps=steps,
        builder_digest=builder_digest(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        weights_sha256=digest,
        val_exact_answer_rate=rate,
        val_rows=EVAL_ROWS,
        build_seconds=round(time.perf_counter() - started, 2),
        num_parameters=sum(p.numel() for p in model.parameters()),
        torch_version=torch.__version__,
        files_sha256=folder_hashes(directory),
    )
    (directory / REPORT_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def portable_tokenizer_class(directory: Path) -> None:
    # transformers 5 writes its own class name (TokenizersBackend); "PreTrainedTokenizerFast" loads in
    # transformers 5 and in the 4.x a vLLM install may bring.
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def folder_hashes(directory: Path) -> dict[str, str]:
    """sha256 of every file of a built folder but its report, by name (about 3 MB: milliseconds)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.is_file() and p.name != REPORT_FILE}


def altered(directory: Path) -> str | None:
    """None when the build in `directory` holds exactly the files its report records, byte for byte; else
    what differs. Sizes and times prove nothing: a file swapped for one of the same size and mtime is found."""
    try:
        recorded = json.loads((directory / REPORT_FILE).read_text()).get("files_sha256")
    except (OSError, ValueError, AttributeError, RecursionError) as err:
        return f"its {REPORT_FILE} is unreadable ({type(err).__name__})"
    if not isinstance(recorded, dict) or not recorded:
        return f"its {REPORT_FILE} records no file hashes"
    found = folder_hashes(directory)
    for name in sorted(set(recorded) | set(found)):
        if recorded.get(name) != found.get(name):
            what = "is missing" if name not in found else "was not written by the build" if name not in recorded \
                else "is not the file the build wrote"
            return f"{name} {what}"
    return None


def read_report(model_dir: str | Path) -> TinyReport:
    return TinyReport(**json.loads((Path(model_dir) / REPORT_FILE).read_text()))


def builder_digest() -> str:
    return source_digest(*(Path(__file__).with_name(name) for name in BUILDER_FILES))


def tiny_cache_path(task: str, seed: int, kernels: dict[str, str] | None = None) -> Path:
    """Where the build of (task, seed) made by this builder with `kernels` (default: this process's) lives."""
    tag = kernel_tag(dict(os.environ) if kernels is None else kernels)
    return cache_dir() / "models" / f"tiny-{task}-s{seed}-{builder_digest()}-{tag}"


def cached_tiny(task: str, seed: int, kernels: dict[str, str] | None = None) -> Path:
    """The cached tiny model for (task, seed), built on first use with the CPU kernels `kernels` pins
    (engine.cpu_kernels.kernel_env; default: this process's own). The variables take effect only before
    torch loads, so a build for kernels this process does not run is made by a process of its own.

    A lock file keeps concurrent builders from doing the work twice; the rename in `build_tiny` keeps
    a crashed build from ever looking complete.
    """
    path = tiny_cache_path(task, seed, kernels)
    if (path / REPORT_FILE).is_file() and altered(path) is None:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (path / REPORT_FILE).is_file():  # built (by another process while we waited), but is it intact?
            why = altered(path)
            if why is None:
                return path
            warnings.warn(f"the cached tiny model {path} is not its build ({why}): building it again", stacklevel=2)
        # Holding the lock, anything half-built here is from a builder that died: clear it away.
        for junk in [path, *path.parent.glob(f".{path.name}.tmp-*")]:
            shutil.rmtree(junk, ignore_errors=True)
        if kernels is None or pinned_here(kernels):
            build_tiny(path, task, seed)
        else:
            build_in_subprocess(path, task, seed, kernels)
    return path


def build_in_subprocess(path: Path, task: str, seed: int, kernels: dict[str, str], steps: int | None = None) -> None:
    """`build_tiny` in a new Python process that starts with `kernels` in place of this one's; its
    progress reports go to this process's reporter."""
    argv = [str(path), task, str(seed), *([] if steps is None else [str(steps)])]
    run_module_pinned("engine.demo.tiny", argv, kernels, f"building the tiny {task} model (seed {seed})",
                      on_line=progress.forward)



def resolve_model_path(model_cfg: ModelConfig, task: str, kernels: dict[str, str] | None = None) -> str:
    """engine.models.loading.resolve_model_path, with model.path=tiny built (once) for `task` with the CPU
    kernels `kernels` pins (engine.cpu_kernels.kernel_env; default: this process's). The flows layer calls
    this, so the engine only ever sees a directory or a hub id."""
    if model_cfg.path == loading.TINY:
        return str(cached_tiny(task, model_cfg.tiny_seed, kernels))
    return loading.resolve_model_path(model_cfg)


def resolve_tokenizer_path(model_cfg: ModelConfig, task: str, kernels: dict[str, str] | None = None) -> str:
    """`model.tokenizer_path` when set (tiny: the tiny model's), else the model's own directory."""
    if model_cfg.tokenizer_path is None:
        return resolve_model_path(model_cfg, task, kernels)
    if model_cfg.tokenizer_path == loading.TINY:
        return resolve_model_path(model_cfg.model_copy(update={"path": loading.TINY}), task, kernels)
    return loading.resolve_tokenizer_path(model_cfg)


if __name__ == "__main__":  # python -m engine.demo.tiny OUT TASK SEED [STEPS]: a build in a process of its own
    with progress.reporting(progress.to_stdout):
        build_tiny(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
