"""What bench/vs_trl.py's workload W4 needs outside its own process, run with rlflow's Python:

    python bench/w4_helpers.py score
        rlflow's reward for TRL's runner: JSON lines in on stdin ({"data_source", "responses",
        "ground_truth", "extra_info"}: lists of one length), one JSON line of scores out per line in,
        through engine.rewards.score_batch, the entry point rlflow's reward stage calls (default
        reward settings: reward.format_weight 0, the task's verifier alone).
    python bench/w4_helpers.py vllm-alone SPEC.json OUT.json
        what vLLM alone does on W4's prompts: rlflow's own rollout class (engine/rollout/vllm.py, its
        default engine size) with nothing around it, on one rank's share of each step's rows (SPEC: model,
        train_file, prompts_per_step, n, max_new_tokens, max_prompt_length, steps, rank, world_size),
        prompts tokenized as rlflow tokenizes them (engine.models.tokens.encode_prompts), sampled at
        temperature 1. OUT: per step, the generate call's wall seconds and generated tokens.
    python bench/w4_helpers.py matmul [THREADS]
        the measured fp32 matmul peak: GFLOP/s of a 2048 x 2048 torch.matmul on THREADS threads (default 2).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def serve_scores() -> None:
    from engine.rewards import score_batch

    for line in sys.stdin:
        job = json.loads(line)
        scored = score_batch(job["data_source"], job["responses"], job["ground_truth"], job["extra_info"])
        print(json.dumps(scored.scores), flush=True)


def matmul_gflops(threads: int = 2, size: int = 2048, repeats: int = 10) -> float:
    """Best of `repeats` timed fp32 matmuls of two size x size matrices (2 size^3 FLOPs each), in GFLOP/s."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def vllm_alone(spec: dict[str, Any]) -> dict[str, Any]:
    import pyarrow.parquet as pq
    from transformers import GenerationConfig

    from engine.config import VllmConfig
    from engine.models.loading import load_tokenizer
    from engine.models.tokens import encode_prompts, stop_token_ids
    from engine.rollout.base import SamplingParams
    from engine.rollout.vllm import VLLMRollout

    tokenizer = load_tokenizer(spec["model"])
    stops = stop_token_ids(tokenizer)
    eos = GenerationConfig.from_pretrained(spec["model"]).eos_token_id
    stops.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    prompts = pq.read_table(spec["train_file"], columns=["prompt"]).column("prompt").to_pylist()
    per_rank = spec["prompts_per_step"] // spec["world_size"]
    engine = VLLMRollout(spec["model"], tokenizer_path=spec["model"], cfg=VllmConfig(),
                         max_model_len=spec["max_prompt_length"] + spec["max_new_tokens"], dtype="float32",
                         stop_ids=sorted(stops), pad_token_id=int(tokenizer.pad_token_id), seed=spec["rank"])
    steps = []
    for step in range(spec["steps"]):
        first = step * spec["prompts_per_step"] + spec["rank"] * per_rank
        rows = [p for p in prompts[first : first + per_rank] for _ in range(spec["n"])]
        encoded = encode_prompts(tokenizer, rows, max_length=spec["max_prompt_length"])
        started = time.perf_counter()
        out = engine.generate(encoded.input_ids, encoded.attention_mask,
                              SamplingParams(max_new_tokens=spec["max_new_tokens"]), seed=step)  # fmt: skip
        steps.append({"gen_s": time.perf_counter() - started, "tokens": int(out.response_mask.sum())})
    return {"steps": steps}


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "score":
        serve_scores()
    elif mode == "vllm-alone":
        Path(sys.argv[3]).write_text(json.dumps(vllm_alone(json.loads(Path(sys.argv[2]).read_text()))))
    elif mode == "matmul":
        print(json.dumps({"gflops": matmul_gflops(int(sys.argv[2]) if len(sys.argv) > 2 else 2)}))
    else:
        raise SystemExit(__doc__)
