"""The engine of one run: its policy worker group and, for PPO, its critic worker group; a rollout pool
(split placement) and a reward model pool (reward.model.placement=pool) when configured.

    engine = Engine.start(spec)                       # a new run, or a restart after a crash
    engine = Engine.attach(spec)                      # a retried / resumed / scheduled flow run
    rollouts = engine.generate(prompts, iteration=7)

Stages address the engine by run id; the actors are found by name, never passed around.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel

from engine.batch import Batch
from engine.errors import ConfigError, EngineDeadError, EngineError, VersionMismatchError
from engine.rewards.reward_model import RewardModelSpec
from engine.workers.group import NAMESPACE, WorkerGroup, check_run_id
from engine.workers.specs import CriticSpec, PolicySpec


class EngineSpec(BaseModel):
    run_id: str
    config_hash: str
    world_size: int = 1
    backend: Literal["gloo", "nccl"] = "gloo"
    num_cpus_per_rank: float = 1.0
    num_gpus_per_rank: float = 0.0
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    namespace: str = NAMESPACE
    timeout_s: float = 1800.0
    timeout_setting: str = "trainer.stage_timeout_s"  # the setting timeout_s comes from (hang messages)
    capacity_timeout_s: float = 300.0  # how long a group waits for the cluster to have room for it
    policy: PolicySpec
    critic: CriticSpec | None = None
    rollout_ranks: int = 0  # placement.mode=split: the rollout pool's ranks (0: colocated)
    rollout_num_cpus_per_rank: float = 1.0
    sync_bucket_mb: float = 32.0
    reward_model: RewardModelSpec | None = None  # reward.model.placement=pool: its own worker group
    reward_model_ranks: int = 0
    reward_model_num_cpus_per_rank: float = 1.0

    def pools(self) -> list[tuple[str, int, float, float]]:
        """(pool, ranks, CPUs per rank, GPUs per rank) of every worker group this engine places."""
        pools = [("policy", self.world_size, self.num_cpus_per_rank, self.num_gpus_per_rank)]
        if self.critic is not None:
            pools.append(("critic", self.world_size, self.num_cpus_per_rank, self.num_gpus_per_rank))
        if self.rollout_ranks:
            pools.append(("rollout", self.rollout_ranks, self.rollout_num_cpus_per_rank, self.num_gpus_per_rank))
        if self.reward_model_ranks:
            pools.append(("reward_model", self.reward_model_ranks, self.reward_model_num_cpus_per_rank,
                          self.num_gpus_per_rank))
        return pools


def check_fits(spec: EngineSpec, cluster: dict[str, float]) -> None:
    """ConfigError, with the numbers, when the engine's pools need more CPUs or GPUs than the Ray
    cluster `cluster` (ray.cluster_resources()) has in all."""
    for resource in ("CPU", "GPU"):
        parts = [(name, ranks, cpus if resource == "CPU" else gpus) for name, ranks, cpus, gpus in spec.pools()]
        need = sum(ranks * per for _, ranks, per in parts)
        have = float(cluster.get(resource, 0.0))
        if need > have + 1e-9:
            detail = " + ".join(f"{name} pool {ranks} x {per:g}" for name, ranks, per in parts if per)
            raise ConfigError(f"the placement does not fit the Ray cluster: {detail} = {need:g} {resource}s, the "
                              f"cluster has {have:g}; lower trainer.world_size or placement.rollout_ranks, or add nodes")


class Engine:
    def __init__(self, spec: EngineSpec, policy: WorkerGroup, critic: WorkerGroup | None,
                 rollout: WorkerGroup | None = None, reward_model: WorkerGroup | None = None) -> None:
        self.spec, self.policy, self.critic, self.rollout = spec, policy, critic, rollout
        self.reward_model = reward_model

    # -- lifecycle ---------------------------------------------------------------------------------
    @classmethod
    def start(cls, spec: EngineSpec, waiting: Callable[[str], None] | None = None, restart: bool = False) -> Engine:
        """Create the worker groups (stopping any leftover actors of this run id first). Split placement:
        the rollout pool too, and the sync group spanning the training group's rank 0 and it. A new
        engine that cannot fit the cluster is refused; a restart (after a lost node) waits for capacity
        up to spec.capacity_timeout_s, reporting to `waiting`."""
        import ray

        # The worker classes only where an engine starts: who attaches (a stage worker) needs none of them.
        from engine.workers.critic import CriticWorker
        from engine.workers.policy import PolicyWorker
        from engine.workers.reward_model_worker import RewardModelWorker
        from engine.workers.rollout_worker import RolloutWorker

        check_run_id(spec.run_id)
        if not restart:
            check_fits(spec, ray.cluster_resources())
        groups: list[WorkerGroup] = []
        try:
            groups.append(cls._create(spec, "policy", PolicyWorker, spec.policy.model_dump(), waiting=waiting))
            critic = rollout = None
            if spec.critic is not None:
                critic = cls._create(spec, "critic", CriticWorker, spec.critic.model_dump(), waiting=waiting)
                groups.append(critic)
            if spec.rollout_ranks:
                rollout = cls._create(spec, "rollout", RolloutWorker, spec.policy.model_dump(),
                                      world_size=spec.rollout_ranks, num_cpus=spec.rollout_num_cpus_per_rank,
                                      waiting=waiting)
                groups.append(rollout)
            reward_model = None
            if spec.reward_model_ranks:
                assert spec.reward_model is not None
                reward_model = cls._create(spec, "reward_model", RewardModelWorker, spec.reward_model.model_dump(),
                                           world_size=spec.reward_model_ranks,
                                           num_cpus=spec.reward_model_num_cpus_per_rank, waiting=waiting)
                groups.append(reward_model)
            engine = cls(spec, groups[0], critic, rollout, reward_model)
            if rollout is not None:
                engine._join_sync_group()
        except BaseException:
            for group in groups:
                group.stop()
            raise
        return engine

    def _join_sync_group(self) -> None:
        """Every member joins at once: the training group's rank 0 (sender) and each rollout rank."""
        from engine.workers.group import gather_results

        assert self.rollout is not None
        host, port = self.policy.call("rendezvous_address", mode="rank0")
        world = 1 + self.rollout.world_size
        timeout = min(self.spec.timeout_s, 300.0)
        refs = [a.join_sync_group.remote(host, port, world, timeout) for a in self.policy.actors]
        refs += [a.join_sync_group.remote(host, port, world, timeout) for a in self.rollout.actors]
        gather_results(refs, "join_sync_group", timeout)

    @classmethod
    def attach(cls, spec: EngineSpec) -> Engine:
        """The live engine of `spec.run_id`; EngineDeadError when it (or one rank) is gone."""
        def group(role: str) -> WorkerGroup:
            return WorkerGroup.attach(run_id=spec.run_id, role=role, config_hash=spec.config_hash,
                                      namespace=spec.namespace, timeout_s=spec.timeout_s,
                                      timeout_setting=spec.timeout_setting)

        engine = cls(spec, group("policy"), group("critic") if spec.critic is not None else None,
                     group("rollout") if spec.rollout_ranks else None,
                     group("reward_model") if spec.reward_model_ranks else None)
        engine.versions()  # the ranks of each role must agree, or the engine is unusable
        return engine

    @classmethod
    def attach_or_start(cls, spec: EngineSpec) -> tuple[Engine, bool]:
        """(engine, attached): attach when alive, otherwise start fresh (the caller then restores)."""
        try:
            return cls.attach(spec), True
        except EngineDeadError:
            cls.stop_run(spec.run_id, spec.namespace)
            return cls.start(spec), False

    @staticmethod
    def stop_run(run_id: str, namespace: str = NAMESPACE) -> list[str]:
        from engine.workers.group import stop_engine

        return stop_engine(run_id, namespace)

    def stop(self) -> None:
        for group in (self.policy, self.critic, self.rollout, self.reward_model):
            if group is not None:
                group.stop()

    @staticmethod
    def _create(spec: EngineSpec, role: str, worker_cls: type, worker_spec: dict[str, Any],
                world_size: int | None = None, num_cpus: float | None = None,
                waiting: Callable[[str], None] | None = None) -> WorkerGroup:
        return WorkerGroup.create(
            run_id=spec.run_id, role=role, worker_cls=worker_cls, world_size=world_size or spec.world_size,
            config_hash=spec.config_hash, init_kwargs={"spec": worker_spec},
            num_cpus_per_rank=num_cpus or spec.num_cpus_per_rank, num_gpus_per_rank=spec.num_gpus_per_rank,
            placement=spec.placement, backend=spec.backend, namespace=spec.namespace, timeout_s=spec.timeout_s,
            capacity_timeout_s=spec.capacity_timeout_s, waiting=waiting,
        )

    def versions(self) -> dict[str, int]:
        """{role: version}; EngineError when the ranks of one role disagree (a half-applied update)."""
        found = {}
        for role, group in (("policy", self.policy), ("critic", self.critic), ("rollout", self.rollout)):
            if group is None:
                continue
            versions = set(group.call("get_version"))
            if len(versions) != 1:
                raise EngineError(f"the {role} ranks of run {self.spec.run_id!r} hold different versions "
                                  f"{sorted(versions)}: restart the engine")
            found[role] = versions.pop()
        return found

    def version(self) -> int:
        """The policy's version: the iteration of its last applied update."""
        return self.versions()["policy"]

    # -- stages ------------------------------------------------------------------------------------
    def generate(self, prompts: Batch, *, iteration: int, expected_version: int | None, do_sample: bool = True,
                 pool: Literal["rollout", "policy"] = "rollout", draw: int = 0, part: int = 0,
                 max_new_tokens: int | None = None) -> Batch:
        """Responses from the rollout pool (split placement) or the policy ranks (colocated, and
        `pool="policy"`: validation, from the training weights). `draw`: the prompt batch's number within
        the iteration (dynamic sampling draws several), part of the sampling seeds; `part`, `max_new_tokens`:
        partial rollouts (engine.workers.policy.generate_batch)."""
        group = self.rollout if pool == "rollout" and self.rollout is not None else self.policy
        return group.call("generate", prompts, mode="dp", iteration=iteration, expected_version=expected_version,
                          do_sample=do_sample, draw=draw, part=part, max_new_tokens=max_new_tokens)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Split placement: the training pool's weights (at `version`) to the rollout pool, in buckets;
        each rollout rank's version becomes `version` once all of it has arrived. Colocated: nothing to
        do (the update refreshed the rollout copy itself)."""
        if self.rollout is None:
            return {}
        from engine.workers.group import gather_results

        policy_version = self.version()
        if policy_version != version:
            raise VersionMismatchError(f"weight sync of version {version}: the training pool of run "
                                       f"{self.spec.run_id!r} is at version {policy_version}")
        mb = self.spec.sync_bucket_mb
        refs = [a.send_weights.remote(mb) for a in self.policy.actors]
        refs += [a.receive_weights.remote(version, mb) for a in self.rollout.actors]
        results = gather_results(refs, "weight sync", self.spec.timeout_s, self.spec.timeout_setting)
        return dict(results[0])

    def score_responses(self, batch: Batch) -> Batch:
        """`rm_score` [B] of the reward model (its own pool, or colocated in the policy ranks) for
        `prompt_json` and `response_text`."""
        group = self.reward_model if self.reward_model is not None else self.policy
        return group.call("score_rm", batch, mode="dp")

    def compute_log_prob(self, batch: Batch, *, expected_version: int | None) -> Batch:
        return self.policy.call("compute_log_prob", batch, mode="dp", expected_version=expected_version)

    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        return self.policy.call("compute_teacher_log_prob", batch, mode="dp")

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return self.policy.call("compute_ref_log_prob", batch, mode="dp")

    def compute_values(self, batch: Batch, *, expected_version: int | None) -> Batch:
        return self._critic().call("compute_values", batch, mode="dp", expected_version=expected_version)

    def update_critic(self, batch: Batch, *, iteration: int, expected_version: int | None) -> dict[str, float]:
        return self._critic().call("update_critic", batch, mode="dp", iteration=iteration,
                                   expected_version=expected_version)[0]

    def update_actor(self, batch: Batch, *, iteration: int, expected_version: int | None) -> dict[str, float]:
        """The actor update, then the train-to-generate weight sync; metrics of both."""
        metrics = self.policy.call("update_actor", batch, mode="dp", iteration=iteration,
                                   expected_version=expected_version)[0]
        metrics.update(self.policy.call("sync_rollout_weights")[0])
        metrics["perf/peak_rss_gb"] = max(self.policy.call("peak_rss_bytes")) / 2**30
        return metrics

    # -- state -------------------------------------------------------------------------------------
    def save(self, url: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Sharded state of every group into `url`/<role>/ (the checkpoint's staging location). Returns
        every file written (path relative to `url`, size, sha256 taken while writing), for the commit."""
        opts = storage_options or {}
        files = []
        for role, group in self._groups():
            for records in group.call("save", f"{url.rstrip('/')}/{role}", opts):
                files += [{**r, "path": f"{role}/{r['path']}"} for r in records]
        return files

    def load(self, url: str, storage_options: dict[str, Any] | None = None,
             expected: dict[str, tuple[int, str]] | None = None) -> int:
        """Restore every group from `url`/<role>/. `expected`: path (relative to `url`) -> (size, sha256)
        of the checkpoint's files (its manifest): each is verified as the ranks read it, and a mismatch
        raises CheckpointCorruptError (the engine's state is then undefined: load another checkpoint)."""
        opts = storage_options or {}
        for role, group in self._groups():
            mine = None if expected is None else \
                {k[len(role) + 1:]: v for k, v in expected.items() if k.startswith(f"{role}/")}
            group.call("load", f"{url.rstrip('/')}/{role}", opts, mine)
        return self.version()

    def _groups(self) -> list[tuple[str, WorkerGroup]]:
        return [("policy", self.policy)] + ([("critic", self.critic)] if self.critic is not None else [])

    def export_hf(self, url: str, storage_options: dict[str, Any] | None = None, merged_url: str | None = None
                  ) -> str:
        """Hugging Face format (save_pretrained + tokenizer) of the current policy at `url`; with LoRA,
        peft's adapter folder there and the merged weights at `merged_url` when given."""
        self.policy.call("export_hf", url, storage_options or {}, merged_url)
        return url

    def drain_spans(self) -> dict[str, list[tuple[str, float, float]]]:
        """{"<role>/<rank>": [(method, start, end), ...]}: every rank's traced calls since the last drain."""
        found = {}
        for role, group in (("policy", self.policy), ("critic", self.critic), ("rollout", self.rollout),
                            ("reward_model", self.reward_model)):
            if group is not None:
                for rank, spans in enumerate(group.call("drain_spans", timeout_s=60.0)):
                    found[f"{role}/{rank}"] = [tuple(s) for s in spans]
        return found

    def weights_digest(self) -> str:
        return str(self.policy.call("weights_digest")[0])

    def _critic(self) -> WorkerGroup:
        if self.critic is None:
            raise EngineError(f"run {self.spec.run_id!r} has no critic (critic.enable is false)")
        return self.critic
