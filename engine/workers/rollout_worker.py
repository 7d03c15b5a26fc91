"""RolloutWorker: a rank of the rollout pool (placement.mode=split). It only generates.

It holds an unsharded copy of the policy (LoRA: the base with the actor's adapters, unmerged) and gets
new weights from the training pool after updates, over the sync group (engine.state.weight_sync); its
`version` is the version of the weights it holds, set only when all of them have arrived. While the
training pool updates, this pool can generate the next rollout (trainer.max_staleness >= 1).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.batch import Batch
from engine.models.loading import dropout_left, empty_model, load_tokenizer
from engine.models.tokens import stop_token_ids
from engine.rollout.backends import make_rollout
from engine.state import weight_sync
from engine.workers.base import RankWorker, traced
from engine.workers.policy import PolicySpec, generate_batch, policy_model, rollout_tools, vllm_engine


class RolloutWorker(RankWorker):
    def __init__(self, *, spec: dict[str, Any], **identity: Any) -> None:
        super().__init__(**identity)
        self.spec = PolicySpec.model_validate(spec)
        self.sync_group: weight_sync.SyncGroup | None = None
        self._fail_after_bucket: int | None = None  # a test fault (debug_fault "fail_mid_sync")

    def setup(self) -> None:
        spec = self.spec
        self.vllm = spec.rollout.name == "vllm"
        if self.vllm:  # the engine holds the weights; an empty (meta) transformers model names what it receives
            torch.manual_seed(spec.seed)
            self.tokenizer = load_tokenizer(spec.tokenizer_path, trust_remote_code=spec.trust_remote_code)
            self.tools = rollout_tools(spec, self.tokenizer)
            empty = empty_model(spec.model_path, trust_remote_code=spec.trust_remote_code)
            self.entries = [(name, tuple(p.shape)) for name, p in empty.named_parameters()]
            self.rollout = make_rollout("vllm", None, int(self.tokenizer.pad_token_id),
                                        sorted(stop_token_ids(self.tokenizer, empty)), **vllm_engine(spec))
            return
        # LoRA: the weights it receives are the adapters, named as on the actor's side.
        self.tokenizer, model, stops, peft = policy_model(spec)
        self.tools = rollout_tools(spec, self.tokenizer)
        self.lora = peft is not None
        if not self.lora:
            model.requires_grad_(False)
        if spec.actor.mixed_precision == "bf16":  # generate with the precision the actor computes in
            model.to(torch.bfloat16)
        self.model = model.eval()
        self.rollout = make_rollout(spec.rollout.name, self.model, int(self.tokenizer.pad_token_id), stops)

    @traced
    def generate(self, prompts: Batch, *, iteration: int, expected_version: int | None, do_sample: bool = True,
                 draw: int = 0, part: int = 0, max_new_tokens: int | None = None) -> Batch:
        """As PolicyWorker.generate, from this rank's copy at `expected_version`."""
        self.check_version(expected_version)
        return generate_batch(self.rollout, prompts, self.spec.rollout, seed=self.spec.seed, iteration=iteration,
                              rank=self.rank, do_sample=do_sample, version=self.version, draw=draw,
                              tokenizer=self.tokenizer, tools=self.tools, isolation=self.spec.sandbox_isolation,
                              prompt_width=self.spec.max_prompt_length, part=part, max_new_tokens=max_new_tokens)

    # -- weights -----------------------------------------------------------------------------------
    def join_sync_group(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        store = self.rendezvous_store(host, port, timeout_s, master=False)
        self.sync_group = weight_sync.join_sync_group(store, 1 + self.rank, world_size, timeout_s)

    def _targets(self) -> dict[str, torch.Tensor]:
        if self.lora:  # the adapters (and modules_to_save): what the actor trains
            return {name: p.data for name, p in self.model.named_parameters() if p.requires_grad}
        tied = weight_sync.tied_duplicates(self.model)  # written through the weight they share
        return {k: v for k, v in self.model.state_dict().items() if k not in tied}

    @traced
    def receive_weights(self, version: int, bucket_mb: float) -> dict[str, float]:
        """The training pool's weights of `version`, bucket by bucket; the version is set last."""
        if self.sync_group is None:
            raise RuntimeError("receive_weights: this rank has not joined the sync group")
        start = time.perf_counter()
        fail = self._fail_after_bucket

        def after_bucket(i: int) -> None:
            if fail is not None and i == fail:
                self._fail_after_bucket = None
                raise RuntimeError(f"fault injected: weight sync stopped after bucket {i}")

        if self.vllm:  # into the engine as the buckets arrive (LoRA: the sender merges)
            received = self.rollout.load_weights(weight_sync.receive_stream(
                self.sync_group, self.entries, int(bucket_mb * 2**20), after_bucket))
        else:
            received = weight_sync.receive(self.sync_group, self._targets(), int(bucket_mb * 2**20), after_bucket)
        self.version = version  # only now: every bucket has arrived
        return {"rollout/receive_s": time.perf_counter() - start, "rollout/received_mb": received / 2**20}

    def full_weights(self) -> dict[str, torch.Tensor]:
        """This rank's generation weights, names as the actor's (for tests)."""
        return {k: v.detach().clone() for k, v in self._targets().items()}

    def dropout_left(self) -> dict[str, list[str]]:
        return {} if self.vllm else {"rollout": dropout_left(self.model)}

    def debug_fault(self, kind: str, rank: int, seconds: float = 0.0) -> str:
        if kind == "fail_mid_sync":  # armed: the next weight sync fails after its first bucket
            if rank == self.rank:
                self._fail_after_bucket = 0
            return "armed"
        return super().debug_fault(kind, rank, seconds)
