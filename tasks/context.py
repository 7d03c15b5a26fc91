"""What a stage needs, rebuilt inside whichever process runs it from a small JSON-able `RunPlan`.

Stage tasks run in Ray worker processes; they receive the plan (public config, resolved paths), never
an actor handle or a credential. Credentials reach the workers through the environment (the task
runner's runtime_env), and the engine is found by run id.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel

from engine.batch import Batch
from engine.config import AlgorithmConfig, DataConfig, RewardConfig, RolloutConfig
from engine.data.prompts import PromptDataset, load_prompts
from engine.data.sampler import PromptSampler
from engine.engine import Engine, EngineSpec
from engine.models.loading import load_tokenizer
from engine.models.tokens import encode_prompts, prompt_lengths
from engine.rollout.tools import describe, load_tools
from infra.checkpoints import CheckpointStore
from infra.config import StorageConfig
from infra.runs import RunStore
from infra.store import ObjectStore
from tasks.faults import FaultConfig
from tasks.graph import StageSpec


class RunPlan(BaseModel):
    """The run as every stage sees it, resolved once by the train flow. JSON-able, no credentials:
    the storage section travels without them and the workers read them from their environment."""

    run_id: str
    created: str  # the run's incarnation: part of every cache key, so a deleted-and-recreated run misses
    config_hash: str
    model_path: str
    tokenizer_path: str
    train_files: list[str]
    val_files: list[str]
    engine: EngineSpec
    data: DataConfig
    rollout: RolloutConfig
    algorithm: AlgorithmConfig
    reward: RewardConfig
    storage: StorageConfig
    stages: list[StageSpec]  # the iteration's declared graph (flows.algorithms.stages_for)
    retry_delays_s: list[float]  # trainer.stage_retry_delays_s: a failed stage's retries, the seconds before each
    max_staleness: int = 0  # trainer.max_staleness: the rollout of iteration i uses version max(0, i-1-k)
    stage_timeouts: dict[str, tuple[float, str]] = {}  # stage name: (seconds, the setting) of its engine calls
    debug: FaultConfig = FaultConfig()


@dataclass
class StageContext:
    """Per-process, per-run state of the stages: config, stores, tokenizer, data, the attached engine."""

    plan: RunPlan
    store: ObjectStore
    runs: RunStore
    checkpoints: CheckpointStore
    _cache: dict[str, Any] = field(default_factory=dict)

    @property
    def tokenizer(self) -> Any:
        if "tokenizer" not in self._cache:
            self._cache["tokenizer"] = load_tokenizer(self.plan.tokenizer_path,
                                                      trust_remote_code=self.plan.engine.policy.trust_remote_code)
        return self._cache["tokenizer"]

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """Multi-turn rollouts: the tools' schemas, which the chat template puts into the prompt."""
        if "tools" not in self._cache:
            mt = self.plan.rollout.multi_turn
            self._cache["tools"] = describe(load_tools(mt.tools)) if mt.enable else None
        return self._cache["tools"]  # type: ignore[no-any-return]

    def dataset(self, split: str) -> PromptDataset:
        """The train or val prompts, filtered by length exactly as the train flow checked them."""
        objective = self.plan.algorithm.objective
        if split not in self._cache and objective in ("sft", "dpo"):  # SFT's conversations or DPO's pairs, each one row
            from engine.data.conversations import load_conversations
            from engine.data.preferences import load_preferences

            files = self.plan.train_files if split == "train" else self.plan.val_files
            loader = load_conversations if objective == "sft" else load_preferences
            self._cache[split] = loader(files, split=split, tokenizer=self.tokenizer,
                                        max_length=self.plan.data.max_length, truncation=self.plan.data.truncation)
        if split not in self._cache:
            files = self.plan.train_files if split == "train" else self.plan.val_files
            self._cache[split] = load_prompts(
                files, split=split, prompt_key=self.plan.data.prompt_key,
                max_prompt_length=self.plan.data.max_prompt_length,
                length_fn=lambda prompt: prompt_lengths(self.tokenizer, [prompt], self.tools)[0],
                truncation=self.plan.data.truncation,
            )
        return self._cache[split]  # type: ignore[no-any-return]

    def engine(self, stage: str | None = None) -> Engine:
        """The run's live engine, attached by name on every call (a few ms): after a restart the
        actors are new, and a handle kept from before would point at dead ones. Its calls time out
        after `stage`'s timeout."""
        spec = self.plan.engine
        if stage in self.plan.stage_timeouts:
            seconds, setting = self.plan.stage_timeouts[stage]
            spec = spec.model_copy(update={"timeout_s": seconds, "timeout_setting": setting})
        return Engine.attach(spec)

    def sampler_at(self, steps: int) -> PromptSampler:
        data = self.plan.data
        sampler = PromptSampler(len(self.dataset("train")), data.train_batch_size, data.seed, data.shuffle)
        sampler.seek(steps)
        return sampler

    def rollout_version(self, iteration: int) -> int:
        """The weights' version the rollout of `iteration` generates with, fixed by the schedule."""
        return max(0, iteration - 1 - self.plan.max_staleness)

    def continue_version(self, iteration: int) -> int:
        """Partial rollouts: the version the unfinished responses of `iteration` continue with (the next)."""
        return max(0, iteration - self.plan.max_staleness)

    def prompt_batch(self, iteration: int) -> Batch:
        """Iteration k's prompts (the sampler's step k-1), each repeated rollout.n times in a group."""
        return self.prompts_at_step(iteration - 1)

    def prompts_at_step(self, step: int) -> Batch:
        """The prompts of the sampler's step `step`, each repeated rollout.n times in a group."""
        indices = self.sampler_at(step).next_indices()
        rows = [self.dataset("train")[i] for i in indices]
        return self._encode(rows, indices).repeat_interleave(self.plan.rollout.n)

    def conversations(self, split: str, indices: list[int]) -> Batch:
        """algorithm.objective=sft or dpo: the conversations or preference pairs at `indices` as training rows
        (engine.data.conversations, engine.data.preferences)."""
        from engine.data.conversations import sft_batch
        from engine.data.preferences import preference_batch

        rows = self.dataset(split)
        build = sft_batch if self.plan.algorithm.objective == "sft" else preference_batch
        return build(self.tokenizer, [rows[i] for i in indices], indices)

    def val_batch(self) -> Batch:
        rows = list(self.dataset("val"))
        return self._encode(rows, list(range(len(rows))))

    def _encode(self, rows: list[Any], indices: list[int]) -> Batch:
        data = self.plan.data
        enc = encode_prompts(self.tokenizer, [r.prompt for r in rows], data.max_prompt_length, data.truncation,
                             self.tools)
        return Batch(
            {
                "input_ids": enc.input_ids,  # [B, P] left padded
                "attention_mask": enc.attention_mask,
                "row_index": torch.tensor(indices, dtype=torch.long),  # the sampler's record
                "group_id": torch.arange(len(rows), dtype=torch.long),  # one group per prompt
            },
            {
                "data_source": [r.data_source for r in rows],
                "ground_truth": [r.ground_truth for r in rows],
                "extra_info": [r.extra_info for r in rows],
                # rollout.env: an episode's init(row) reads the row's prompt
                **({"prompt_json": [json.dumps(r.prompt) for r in rows]} if self.plan.rollout.episodes else {}),
            },
        )


def context(plan: RunPlan | dict[str, Any]) -> StageContext:
    """The stage context of `plan` in this process (built once per process and run)."""
    plan = plan if isinstance(plan, RunPlan) else RunPlan.model_validate(plan)
    return _context(plan.model_dump_json())


@functools.lru_cache(maxsize=4)
def _context(plan_json: str) -> StageContext:
    plan = RunPlan.model_validate_json(plan_json)
    store = ObjectStore.from_config(plan.storage)
    return StageContext(
        plan=plan, store=store, runs=RunStore(store, plan.run_id),
        checkpoints=CheckpointStore(store, plan.run_id, plan.storage.keep_last, plan.storage.keep_every),
    )
