"""TRL's GRPOTrainer on one workload of bench/vs_trl.py; runs in TRL's own virtual environment.

    <trl-venv>/bin/python bench/trl_grpo_runner.py SPEC.json OUT.json

SPEC: model (a save_pretrained folder), train_file (verl-format parquet: prompt messages,
reward_model.ground_truth), prompts_per_step, n, max_new_tokens, lr, beta, steps, seed, threads, and
optionally bf16 and gradient_checkpointing (TRL's own options; both off by default here), and use_vllm
(TRL's colocated vLLM: `use_vllm=True, vllm_mode="colocate"`, sized by vllm_memory_share), and
micro_batch_size (completions per forward/backward: the step's completions are generated at once and
the update accumulates gradients over micro-batches of this many into one optimizer step, rlflow's
actor.micro_batch_size; default: all of them in one pass).
OUT: per-step wall seconds (from a callback at each optimizer step, so generation, reward, loss and the
update are all inside), the seconds of the model's generate calls in each step, prompt and completion
tokens per step, mean reward per step, peak RSS.

It imports nothing of rlflow but the sort reward, loaded by file path from engine/rewards/rules.py
(standard library only), so that both frameworks score with the same function. With `"reward":
"reasoning_gym"` (W4) the rows' data_source and extra_info go to rlflow's own reward stage entry point,
engine.rewards.score_batch, in a process of rlflow's Python (`reward_python`: bench/w4_helpers.py score,
JSON lines over a pipe; its peak RSS is reported as scorer_peak_rss_gb), and the runner first checks
that TRL's tokens of the prompts (apply_chat_template with the generation prompt, tokenized) are
rlflow's (the template's text tokenized without added special tokens) and within max_prompt_length.
"""

from __future__ import annotations

import importlib.util
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _sort_score():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("rlflow_rules", REPO / "engine" / "rewards" / "rules.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sort_score


class _Scorer:
    """rlflow's reward (engine.rewards.score_batch) in a process of rlflow's Python, one JSON line per batch."""

    def __init__(self, python: str) -> None:
        self.proc = subprocess.Popen([python, str(REPO / "bench" / "w4_helpers.py"), "score"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.__name__ = "reasoning_gym_reward"  # TRL names each reward function's logged column by it

    def __call__(self, completions, data_source, ground_truth, extra_info, **kwargs):  # noqa: ANN001, ANN003, ANN204
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"data_source": list(data_source), "responses": texts,
                                          "ground_truth": list(ground_truth), "extra_info": list(extra_info)}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the reward process ended ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> float:
        """Peak RSS of the reward process, GB (it is this process's only child)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()
        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20


def _check_prompt_tokens(tokenizer, prompts: list, max_length: int) -> int:  # noqa: ANN001
    """The longest prompt in tokens; raises unless TRL's tokens of each conversational prompt are rlflow's
    (engine/models/tokens.py: the template's text with the generation prompt, no special tokens added)."""
    longest = 0
    for messages in prompts:
        ours = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]  # fmt: skip
        theirs = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        ids = list(theirs["input_ids"])
        ids = list(ids[0]) if ids and isinstance(ids[0], list) else ids  # a batch of one, in some versions
        if ids != list(ours):
            raise SystemExit(f"TRL's prompt tokens differ from rlflow's for {messages[-1]['content'][:60]!r}")
        longest = max(longest, len(ours))
    if longest > max_length:
        raise SystemExit(f"a prompt of {longest} tokens exceeds max_prompt_length={max_length} (TRL would cut it)")
    return longest


def _vllm_options(spec: dict) -> dict:
    """TRL's colocated vLLM engine: one in-process LLM next to the trained model, weights pushed each step."""
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": spec.get("vllm_memory_share", 0.1),
            "vllm_max_model_length": spec.get("vllm_max_model_len", 512), "vllm_enable_sleep_mode": False}


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    table = datasets.load_dataset("parquet", data_files=spec["train_file"], split="train")
    kept = ("prompt", "data_source", "extra_info") if spec.get("reward") == "reasoning_gym" else ("prompt",)
    table = table.map(lambda row: {"prompt": list(row["prompt"]), "ground_truth": row["reward_model"]["ground_truth"]},
                      remove_columns=[c for c in table.column_names if c not in kept])  # fmt: skip
    scorer: _Scorer | None = None
    if spec.get("reward") == "reasoning_gym":
        scorer = _Scorer(spec["reward_python"])
        reward_funcs = [scorer]
    else:
        score = _sort_score()

        def sort_reward(completions, ground_truth, **kwargs):  # noqa: ANN001, ANN202, ANN003
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [score("rlflow/sort", t, g) for t, g in zip(texts, ground_truth, strict=True)]

        reward_funcs = [sort_reward]

    completions = spec["prompts_per_step"] * spec["n"]
    micro = spec.get("micro_batch_size", completions)
    if completions % micro or micro % spec["n"]:
        raise SystemExit(f"micro_batch_size={micro} must divide the {completions} completions and be a multiple of n")
    config = GRPOConfig(
        output_dir=str(Path(out_path).parent / "trl-out"),
        # completions, not prompts; all generated at once (steps_per_generation defaults to the accumulation)
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=completions // micro,
        num_generations=spec["n"],
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=spec["beta"],
        epsilon=0.2,
        loss_type="dapo",  # token-mean over the batch: rlflow's loss_agg_mode=token-mean
        scale_rewards="group",  # GRPO with the group std: rlflow's grpo, norm_by_std=True
        num_iterations=1,
        max_steps=spec["steps"],
        bf16=spec.get("bf16", False),  # mixed precision: fp32 master weights, bf16 autocast
        fp16=False,
        gradient_checkpointing=spec.get("gradient_checkpointing", False),
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=spec["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
        **(_vllm_options(spec) if spec.get("use_vllm") else {}),
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    longest_prompt = None
    if "max_prompt_length" in spec:
        longest_prompt = _check_prompt_tokens(tokenizer, list(table["prompt"]), spec["max_prompt_length"])
    steps: list[dict[str, float]] = []
    generating = [0.0]  # seconds in the model's generate calls since the last step end
    generate = model.generate

    def timed_generate(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        started = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            generating[0] += time.perf_counter() - started

    model.generate = timed_generate  # TRL's transformers generation calls the model's own generate

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            now = time.perf_counter()
            steps.append({"step_s": now - self.last, "gen_s": generating[0]})
            self.last, generating[0] = now, 0.0

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if logs and "reward" in logs and steps:
                steps[-1].update(reward=logs["reward"], num_tokens=logs.get("num_tokens", 0.0),
                                 completion_length=logs.get("completions/mean_length", 0.0))  # fmt: skip

    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward_funcs, args=config,
                          train_dataset=table, callbacks=[Clock()])  # fmt: skip
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    previous = 0.0
    for step in steps:  # TRL logs the cumulative token count (prompts + completions)
        cumulative = step.get("num_tokens", previous)
        step["total_tokens"] = cumulative - previous
        step["completion_tokens"] = step.get("completion_length", 0.0) * completions
        previous = cumulative
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    scorer_gb = scorer.close() if scorer is not None else 0.0
    Path(out_path).write_text(json.dumps({"steps": steps, "total_s": total, "peak_rss_gb": peak_gb,
                                          "scorer_peak_rss_gb": scorer_gb, "longest_prompt": longest_prompt},
                                         indent=1))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
