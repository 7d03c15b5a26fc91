"""TRL's GRPOTrainer on one workload of bench/vs_trl.py; runs in TRL's own virtual environment.

    <trl-venv>/bin/python bench/trl_grpo_runner.py SPEC.json OUT.json

SPEC: model (a save_pretrained folder), train_file (verl-format parquet: prompt messages,
reward_model.ground_truth), prompts_per_step, n, max_new_tokens, lr, beta, steps, seed, threads, and
optionally bf16 and gradient_checkpointing (TRL's own options; both off by default here), and use_vllm
(TRL's colocated vLLM: `use_vllm=True, vllm_mode="colocate"`, sized by vllm_memory_share).
OUT: per-step wall seconds (from a callback at each optimizer step, so generation, reward, loss and the
update are all inside), prompt and completion tokens per step, mean reward per step, peak RSS.

It imports nothing of rlflow but the sort reward, loaded by file path from engine/rewards/rules.py
(standard library only), so that both frameworks score with the same function.
"""

from __future__ import annotations

import importlib.util
import json
import resource
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

    score = _sort_score()
    table = datasets.load_dataset("parquet", data_files=spec["train_file"], split="train")
    table = table.map(lambda row: {"prompt": list(row["prompt"]), "ground_truth": row["reward_model"]["ground_truth"]},
                      remove_columns=[c for c in table.column_names if c not in ("prompt",)])  # fmt: skip

    def sort_reward(completions, ground_truth, **kwargs):  # noqa: ANN001, ANN202, ANN003
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score("rlflow/sort", t, g) for t, g in zip(texts, ground_truth, strict=True)]

    completions = spec["prompts_per_step"] * spec["n"]
    config = GRPOConfig(
        output_dir=str(Path(out_path).parent / "trl-out"),
        per_device_train_batch_size=completions,  # completions, not prompts
        gradient_accumulation_steps=1,
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
    steps: list[dict[str, float]] = []

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            now = time.perf_counter()
            steps.append({"step_s": now - self.last})
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if logs and "reward" in logs and steps:
                steps[-1].update(reward=logs["reward"], num_tokens=logs.get("num_tokens", 0.0),
                                 completion_length=logs.get("completions/mean_length", 0.0))  # fmt: skip

    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[sort_reward], args=config,
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
    Path(out_path).write_text(json.dumps({"steps": steps, "total_s": total, "peak_rss_gb": peak_gb}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
