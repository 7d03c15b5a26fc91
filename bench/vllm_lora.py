"""Benchmark: LoRA into vLLM two ways, side by side in one process (issue [3/8] item 2).

    python bench/vllm_lora.py [--workload W2] [--rank 8] [--versions 4] [--rows 64]

merged: what rollout.name=vllm does. After each update every weight goes into the engine with the
    adapters merged (W + scaling * B @ A, by engine/workers/fsdp.stream_full itself) through vLLM's
    in-place reload (engine/rollout/vllm.py); generation then runs the plain base model.
adapter: vLLM's own LoRA support. The engine starts with enable_lora; after each update the adapters
    alone are saved (peft's save_pretrained, what a worker would write) and the next generate names them in
    a LoRARequest with a new id, so vLLM loads them; generation runs base + adapters.

Each way, per new adapter version (the first version left out as warm-up): seconds to get the new
weights in (adapter: saving them; vLLM loads them inside the next generate, counted there), generated
tokens per second of the sampled rollout after it, and whether the greedy tokens
equal those of the same weights merged in transformers. One model (bench/vs_trl.py's workload), LoRA on
every linear layer of the blocks, B drawn at random for each version (a trained adapter's size), one
thread each. Results: bench/results/vllm_lora.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import vs_trl  # noqa: E402  (the workloads' models)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def new_version(model: Any, version: int) -> None:
    """Adapters of a new version: A and B drawn from a seed of the version (B nonzero, unlike peft's init)."""
    import torch

    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)


def merged_weights(model: Any) -> list[tuple[str, Any]]:
    """(name, tensor) of the model with its adapters merged, under the base model's names: the engine's own
    stream (engine/workers/fsdp.stream_full, here over one process's unsharded model)."""
    from engine.workers.fsdp import stream_full
    from engine.workers.policy import SYNC_BUCKET_BYTES

    return list(stream_full(model.base_model.model, SYNC_BUCKET_BYTES))


def greedy_hf(model: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
            out.append(seq[0, len(ids):].tolist())
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import os

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.rollout.vllm import VLLM_ENV

    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    torch.set_num_threads(1)
    work = args.work.expanduser().resolve()
    model_dir, data = vs_trl.build_inputs(work, args.workload)
    spec = vs_trl.WORKLOADS[args.workload]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    import datasets

    table = datasets.load_dataset("parquet", data_files=str(data), split="train")
    texts = [tokenizer.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
             for row in table.select(range(args.rows))]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    tokens = spec["max_new_tokens"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS))
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    sampled = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True, detokenize=False)
               for i in range(len(prompts))]
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    check = prompts[:4]
    results: dict[str, Any] = {}
    for way in ("merged", "adapter"):
        extra = {"enable_lora": True, "max_lora_rank": args.rank, "max_loras": 1} if way == "adapter" else {}
        llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, seed=0, enforce_eager=True,
                  kv_cache_memory_bytes=2**30, **extra)
        tmp = Path(tempfile.mkdtemp(prefix="rlflow-lora-bench-"))
        rows: list[dict[str, Any]] = []
        for version in range(1, args.versions + 1):
            new_version(model, version)
            started = time.perf_counter()
            request = None
            if way == "merged":
                weights = merged_weights(model)

                def reload(worker: Any, weights: list = weights) -> None:
                    worker.reload_weights(weights_iterator=iter(weights))

                llm.collective_rpc(reload)
                llm.reset_prefix_cache()
            else:
                folder = tmp / f"v{version}"
                model.save_pretrained(folder)
                request = LoRARequest(f"v{version}", version, str(folder))
            sync_s = time.perf_counter() - started
            started = time.perf_counter()
            outs = llm.generate(inputs, sampled, use_tqdm=False, lora_request=request)
            gen_s = time.perf_counter() - started  # adapter: includes vLLM loading the new version on first use
            made = sum(len(o.outputs[0].token_ids) for o in outs)
            got = [list(o.outputs[0].token_ids) for o in
                   llm.generate([{"prompt_token_ids": p} for p in check], greedy, use_tqdm=False, lora_request=request)]
            want = greedy_hf(model, check, tokens)
            rows.append({"version": version, "sync_s": sync_s, "gen_s": gen_s, "tok_s": made / gen_s,
                         "greedy_equal": got == want})
            print(f"[{way} v{version}] in {sync_s * 1000:.0f} ms, generation {gen_s:.2f} s ({made / gen_s:.0f} tok/s), "
                  f"greedy equal to transformers: {got == want}", flush=True)
        steady = rows[1:] or rows
        results[way] = {"sync_ms": 1000 * statistics.median(r["sync_s"] for r in steady),
                        "gen_s": statistics.median(r["gen_s"] for r in steady),
                        "tok_s": statistics.median(r["tok_s"] for r in steady),
                        "greedy_equal": all(r["greedy_equal"] for r in rows), "rows": rows}
        del llm
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="W2")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "rlflow-bench")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vllm_lora.json")
    args = parser.parse_args()
    results = run(args)
    results["meta"] = {"command": " ".join(["vllm_lora.py", *sys.argv[1:]]), "workload": args.workload,
                       "rank": args.rank, "rows": args.rows}
    args.out.write_text(json.dumps(results, indent=1))
    print("| LoRA into vLLM | new weights in (ms) | generation s | generated tok/s | greedy = transformers |")
    print("|---|---|---|---|---|")
    for way in ("merged", "adapter"):
        r = results[way]
        print(f"| {way} | {r['sync_ms']:.0f} | {r['gen_s']:.2f} | {r['tok_s']:.0f} | {r['greedy_equal']} |")


if __name__ == "__main__":
    main()
