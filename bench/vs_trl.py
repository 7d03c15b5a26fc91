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
"""

from __future__ import annotations

import argparse
import json
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
}
LR = 2e-4
# name -> (rlflow overrides, TRL's equivalent options)
SETTINGS: dict[str, tuple[list[str], dict[str, bool]]] = {
    "fp32": ([], {}),
    "bf16": (["actor.mixed_precision=bf16"], {"bf16": True}),
    "bf16+gc": (["actor.mixed_precision=bf16", "actor.gradient_checkpointing=true"],
                {"bf16": True, "gradient_checkpointing": True}),
    "fp32+gc": (["actor.gradient_checkpointing=true"], {"gradient_checkpointing": True}),
    "fp32+copy": (["rollout.weights=copy"], {}),  # the rollout's own unsharded copy of the actor
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
    res = _summary([r["step_s"] for r in rows], [r["completion_tokens"] for r in rows],
                   [r["total_tokens"] for r in rows], [r["reward"] for r in rows], result["peak_rss_gb"], wall)
    res["rank_peak_gb"] = result["peak_rss_gb"]  # one process
    return res


def run_rlflow(work: Path, name: str, model: Path, data: Path, beta: float, steps: int, tag: str,
               world_size: int, home: Path, extra: list[str]) -> dict[str, Any]:  # fmt: skip
    spec = WORKLOADS[name]
    completions = spec["prompts"] * spec["n"]
    out = work / "out" / f"rlflow-{name}-b{beta}-{tag}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    kl = ["actor.use_kl_loss=true", f"actor.kl_loss_coef={beta}", "actor.kl_loss_type=k3"] if beta else []
    overrides = [
        f"model.path={model}", f"data.train_files=[{data}]", f"data.train_batch_size={spec['prompts']}",
        f"rollout.n={spec['n']}", f"rollout.max_new_tokens={spec['max_new_tokens']}", f"actor.lr={spec.get('lr', LR)}",
        f"actor.mini_batch_size={completions}", "trainer.val_every=0", f"trainer.total_iterations={steps}",
        f"trainer.save_every={steps}", "trainer.export_at_end=false", f"trainer.world_size={world_size}",
        f"trainer.run_id=bench-{name}-{tag}", f"storage.root={out / 'runs'}", *spec["rlflow"], *kl, *extra,
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
                      mem.peak / 2**30, wall)  # fmt: skip
    result["rank_peak_gb"] = max(m.get("perf/peak_rss_gb", 0.0) for m in rows)
    steady = rows[WARMUP:] or rows
    for key in sorted({k for m in steady for k in m if k.startswith("timing_s/")} | {"perf/orchestration_s"}):
        result[key] = statistics.median(m.get(key, 0.0) for m in steady)
    return result


def _summary(step_s: list[float], gen_tokens: list[float], total_tokens: list[float], reward: list[float],
             peak_gb: float, wall: float) -> dict[str, Any]:  # fmt: skip
    # The first two steps warm up (rlflow: Ray starts and fills the stage workers' processes).
    steady = slice(WARMUP, None) if len(step_s) > WARMUP else slice(None)
    sec = statistics.median(step_s[steady])
    return {
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
    try:
        for name in args.workloads.split(","):
            model, data = build_inputs(work, name)
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
                    _write(args.out, results, args)
    finally:
        stack.down()
    _print_table(results)


def _medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = {who: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for who, rs in runs.items() if rs}
    if "rlflow" in med and "trl" in med:
        a, b = med["rlflow"], med["trl"]
        med["ratio"] = {"speed (trl s/step / rlflow s/step)": b["s_per_step"] / a["s_per_step"],
                        "gen_tok_s": a["gen_tok_s"] / b["gen_tok_s"], "total_tok_s": a["total_tok_s"] / b["total_tok_s"],
                        "peak_gb": a["peak_gb"] / b["peak_gb"],
                        "rank_peak_gb": a["rank_peak_gb"] / b["rank_peak_gb"]}  # fmt: skip
    return med


def _write(path: Path, results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "steps": args.steps,
            "repeats": args.repeats, "world_size": args.world_size, "trl": TRL_VERSION, "threads": THREADS}  # fmt: skip
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


def _print_table(results: list[dict[str, Any]]) -> None:
    print("| workload | beta | setting | framework | s/step | gen tok/s | total tok/s | peak GB (all) | peak GB (rank) "
          "| reward first -> last 3 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        setting = res.get("setting", "fp32")
        for who in ("trl", "rlflow"):
            m = res["median"].get(who)
            if m:
                what = f"trl {json.dumps(res['trl_options'])}" if who == "trl" else who
                print(f"| {res['workload']} | {res['beta']} | {setting} | {what} | {m['s_per_step']:.3f} | "
                      f"{m['gen_tok_s']:.0f} | {m['total_tok_s']:.0f} | {m['peak_gb']:.2f} | {m['rank_peak_gb']:.2f} | "
                      f"{m['reward_first']:.3f} -> {m['reward_last3']:.3f} |")
        if "ratio" in res["median"]:
            print(f"| {res['workload']} | {res['beta']} | {setting} | ratio | " + " | ".join(
                f"{k}: {v:.2f}x" for k, v in res["median"]["ratio"].items()) + " |")


if __name__ == "__main__":
    main()
