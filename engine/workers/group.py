"""WorkerGroup: N rank actors in one placement group, detached and named, so later flow runs attach.

    group = WorkerGroup.create(run_id="r1", role="policy", worker_cls=PolicyWorker, world_size=2, ...)
    out = group.call("generate", batch, mode="dp")          # split, run on every rank, gather in order
    same = WorkerGroup.attach(run_id="r1", role="policy", config_hash=h)   # from another process

Actors are named `<run_id>/<role>/<rank>` in the Ray namespace `rlflow` with `lifetime="detached"`: they
outlive the process that created them (a flow run) and live until `stop()` or the Ray cluster ends.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.batch import Batch
from engine.errors import EngineDeadError, EngineError, EngineHungError

NAMESPACE = "rlflow"
Dispatch = Literal["one_to_all", "dp", "rank0"]
# What may name a run's actors (`<run_id>/<role>/<rank>`): no '/', so a name splits back into its parts.
# Storage's rule for a run's folder (infra.layout.RUN_ID) is the same; tests/test_layers.py holds them
# equal, since infra may import nothing of the engine but engine.batch. fullmatch: `$` lets a final
# newline through.
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def actor_name(run_id: str, role: str, rank: int) -> str:
    return f"{run_id}/{role}/{rank}"


def check_run_id(run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id):
        raise EngineError(f"run id {run_id!r} is not allowed: use letters, digits, '.', '_' or '-' (at most 128)")
    return run_id


@dataclass
class WorkerGroup:
    run_id: str
    role: str
    actors: list[Any]
    timeout_s: float = 1800.0
    namespace: str = NAMESPACE
    timeout_setting: str = "trainer.stage_timeout_s"  # what a hang message names

    @property
    def world_size(self) -> int:
        return len(self.actors)

    # -- lifecycle ---------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        *,
        run_id: str,
        role: str,
        worker_cls: type,
        world_size: int,
        config_hash: str,
        init_kwargs: dict[str, Any],
        num_cpus_per_rank: float = 1.0,
        num_gpus_per_rank: float = 0.0,
        placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack",
        backend: str = "gloo",
        namespace: str = NAMESPACE,
        timeout_s: float = 1800.0,
        capacity_timeout_s: float = 300.0,
        waiting: Callable[[str], None] | None = None,
    ) -> WorkerGroup:
        """Start the ranks in a detached placement group and form their torch.distributed group. Until
        the cluster has room for the group (a lost node not yet replaced), wait up to `capacity_timeout_s`,
        telling `waiting` every few seconds how many ranks the alive nodes could place."""
        check_run_id(run_id)
        bundle = {"CPU": num_cpus_per_rank, **({"GPU": num_gpus_per_rank} if num_gpus_per_rank else {})}
        pg = placement_group(
            [bundle] * world_size,
            strategy=placement.upper(),
            name=f"{run_id}/{role}/pg",
            lifetime="detached",
        )
        _wait_placed(pg, bundle, world_size, placement.upper(), capacity_timeout_s, waiting, f"{run_id}/{role}")
        remote_cls = ray.remote(worker_cls)
        actors = []
        for rank in range(world_size):
            actors.append(
                remote_cls.options(
                    name=actor_name(run_id, role, rank),
                    namespace=namespace,
                    lifetime="detached",
                    max_restarts=0,
                    num_cpus=num_cpus_per_rank,
                    num_gpus=num_gpus_per_rank,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                ).remote(
                    run_id=run_id, role=role, rank=rank, world_size=world_size, config_hash=config_hash,
                    num_threads=max(1, int(num_cpus_per_rank)), **init_kwargs,
                )
            )
        group = cls(run_id, role, actors, timeout_s, namespace)
        try:
            host, port = group.call("rendezvous_address", mode="rank0")
            group.call("init_distributed", host, port, backend, timeout_s)
            group.call("setup")
        except BaseException:
            group.stop()
            raise
        return group

    @classmethod
    def attach(cls, *, run_id: str, role: str, config_hash: str | None, namespace: str = NAMESPACE,
               timeout_s: float = 1800.0, timeout_setting: str = "trainer.stage_timeout_s") -> WorkerGroup:
        """The live group of `run_id`, or EngineDeadError when any rank is gone."""
        try:
            first = ray.get_actor(actor_name(run_id, role, 0), namespace=namespace)
        except ValueError:
            raise EngineDeadError(f"no live {role} workers for run {run_id!r}") from None
        info = _get(first.ping.remote(), rank=0, method="ping", timeout_s=60.0)
        if config_hash is not None and info["config_hash"] != config_hash:
            raise EngineError(
                f"the live {role} workers of run {run_id!r} were started with config {info['config_hash'][:12]}, "
                f"this run has config {config_hash[:12]}: stop them (`rlflow engine stop {run_id}`) "
                "or run with the config they were started with"
            )
        actors = [first]
        for rank in range(1, info["world_size"]):
            try:
                actors.append(ray.get_actor(actor_name(run_id, role, rank), namespace=namespace))
            except ValueError:
                raise EngineDeadError(f"rank {rank} of the {role} workers of run {run_id!r} is gone") from None
        group = cls(run_id, role, actors, timeout_s, namespace, timeout_setting)
        group.health()
        return group

    def health(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Every rank's ping (rank, version, pid); EngineDeadError when one does not answer."""
        return self.call("ping", timeout_s=timeout_s)

    def stop(self) -> None:
        """Kill the ranks and free their placement group. Safe to call twice."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        remove_placement_groups(self.run_id, self.role)

    # -- dispatch ----------------------------------------------------------------------------------
    def call(self, method: str, *args: Any, mode: Dispatch = "one_to_all", timeout_s: float | None = None,
             **kwargs: Any) -> Any:
        """Run `method` on the ranks.

        one_to_all: the same arguments to every rank; returns the list of results in rank order.
        dp: every Batch argument is split into world_size equal shards (padded by wrapping rows); rank r
            gets shard r; Batch results are concatenated in rank order and unpadded, others listed.
        rank0: only rank 0; returns its result.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if mode == "rank0":
            return _get(getattr(self.actors[0], method).remote(*args, **kwargs), 0, method, timeout)
        if mode == "one_to_all":
            refs = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
            return gather_results(refs, method, timeout, self.timeout_setting)
        if mode == "dp":
            return self._call_dp(method, args, kwargs, timeout)
        raise ValueError(f"dispatch mode {mode!r} is not one of one_to_all, dp, rank0")

    def _call_dp(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float) -> Any:
        n = self.world_size
        pad = 0
        shard_args: list[list[Any]] = [[] for _ in range(n)]
        for arg in args:
            shards, pad = arg.split(n) if isinstance(arg, Batch) else ([arg] * n, pad)
            for rank in range(n):
                shard_args[rank].append(shards[rank])
        shard_kwargs: list[dict[str, Any]] = [{} for _ in range(n)]
        for key, arg in kwargs.items():
            shards, pad = arg.split(n) if isinstance(arg, Batch) else ([arg] * n, pad)
            for rank in range(n):
                shard_kwargs[rank][key] = shards[rank]
        refs = [getattr(a, method).remote(*shard_args[r], **shard_kwargs[r]) for r, a in enumerate(self.actors)]
        results = gather_results(refs, method, timeout, self.timeout_setting)
        if results and all(isinstance(r, Batch) for r in results):
            return Batch.unpad(Batch.concat(results), pad)
        return results


def list_engines(namespace: str = NAMESPACE) -> dict[str, dict[str, list[int]]]:
    """{run_id: {role: [ranks]}} of the named rank actors alive in the namespace."""
    found: dict[str, dict[str, list[int]]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != namespace:
            continue
        parts = entry["name"].split("/")
        if len(parts) == 3 and parts[2].isdigit():
            found.setdefault(parts[0], {}).setdefault(parts[1], []).append(int(parts[2]))
    return {run: {role: sorted(ranks) for role, ranks in roles.items()} for run, roles in sorted(found.items())}


def engine_namespaces() -> dict[str, list[str]]:
    """{run_id: [the Ray namespaces where it has live rank actors]}: every namespace (ray.namespace)."""
    found: dict[str, set[str]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        parts = entry["name"].split("/")
        if len(parts) == 3 and parts[2].isdigit():
            found.setdefault(parts[0], set()).add(entry.get("namespace") or "")
    return {run: sorted(spaces) for run, spaces in sorted(found.items())}


def _engine_pgs() -> list[tuple[str, str, str]]:
    """(placement group id, run id, role) of every engine placement group alive on the cluster, in every
    Ray namespace (the cluster's table: a lookup by name sees this driver's namespace only)."""
    found = []
    for pg_id, entry in ray.util.placement_group_table().items():
        parts = (entry.get("name") or "").split("/")
        if entry.get("state") != "REMOVED" and len(parts) == 3 and parts[2] == "pg":
            found.append((pg_id, parts[0], parts[1]))
    return found


def engine_placement_groups() -> dict[str, list[str]]:
    """{run_id: [roles]} of the engines' placement groups alive on the cluster, in every namespace: a
    group whose ranks all died (a killed rank of a one-rank engine) still holds its CPUs."""
    found: dict[str, set[str]] = {}
    for _, run_id, role in _engine_pgs():
        found.setdefault(run_id, set()).add(role)
    return {run: sorted(roles) for run, roles in sorted(found.items())}


def remove_placement_groups(run_id: str, role: str | None = None) -> list[str]:
    """Remove `run_id`'s placement groups (one role's, or all), in whichever namespace the run created
    them. Returns the roles whose group was removed."""
    removed = []
    for pg_id, run, pg_role in _engine_pgs():
        if run == run_id and role in (None, pg_role):
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
            except Exception:  # removed meanwhile
                continue
            removed.append(pg_role)
    return sorted(removed)


def stop_engine(run_id: str, namespace: str = NAMESPACE) -> list[str]:
    """Kill every rank actor of `run_id` and its placement groups (those of ranks already dead too);
    returns the roles stopped."""
    roles = list_engines(namespace).get(run_id, {})
    for role, ranks in roles.items():
        actors = []
        for rank in ranks:
            try:
                actors.append(ray.get_actor(actor_name(run_id, role, rank), namespace=namespace))
            except ValueError:
                continue
        WorkerGroup(run_id, role, actors, namespace=namespace).stop()
    return sorted(set(roles) | set(remove_placement_groups(run_id)))


def gather_results(refs: list[Any], method: str, timeout_s: float, setting: str = "trainer.stage_timeout_s") -> list[Any]:
    """Results in rank order; the FIRST failure is raised at once (the other ranks may be stuck in a
    collective waiting for the failed one, so waiting for all would turn an error into a hang)."""
    deadline = time.monotonic() + timeout_s
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            ranks = sorted(rank_of[r] for r in pending)
            raise EngineHungError(f"rank(s) {ranks} made no progress in {method} for {timeout_s:g} s "
                                  f"({setting}): declared hung")
        ref = ready[0]
        results[rank_of[ref]] = _get(ref, rank_of[ref], method, 0.0)
    return [results[rank] for rank in range(len(refs))]


def _get(ref: Any, rank: int, method: str, timeout_s: float) -> Any:
    try:
        return ray.get(ref, timeout=timeout_s if timeout_s > 0 else None)
    except GetTimeoutError:
        raise EngineError(f"rank {rank} did not finish {method} within {timeout_s:g} s") from None
    except (ActorDiedError, ActorUnavailableError) as err:
        raise EngineDeadError(f"rank {rank} died during {method}: {_first_line(err)}") from None
    except RayActorError as err:
        raise EngineDeadError(f"rank {rank} is unavailable for {method}: {_first_line(err)}") from None
    except RayTaskError as err:
        cause = err.cause
        if isinstance(cause, EngineError):  # the rank refused the call: keep the kind (e.g. a version mismatch)
            raise type(cause)(f"rank {rank} refused {method}: {cause}") from None
        raise EngineError(f"rank {rank} failed in {method}: {cause!r}\nremote traceback:\n{err}") from None


_WAIT_REPORT_S = 10.0


def _wait_placed(pg: Any, bundle: dict[str, float], ranks: int, strategy: str, timeout_s: float,
                 waiting: Callable[[str], None] | None, what: str) -> None:
    """Wait for the placement group; on timeout remove it (no half-reserved cluster) and EngineError."""
    deadline = time.monotonic() + timeout_s
    need = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
    while True:
        ready, _ = ray.wait([pg.ready()], timeout=max(0.0, min(_WAIT_REPORT_S, deadline - time.monotonic())))
        if ready:
            return
        placeable = _placeable(bundle, ranks, strategy)
        status = f"{ranks} ranks of {need} each ({strategy}): {placeable} of {ranks} ranks placeable on the alive nodes"
        if time.monotonic() >= deadline:
            remove_placement_group(pg)
            raise EngineError(f"the {what} workers could not be placed within {timeout_s:g} s "
                              f"(trainer.capacity_timeout_s): {status}; add nodes, then resume the run")
        if waiting is not None:
            waiting(f"waiting for capacity: the {what} workers need {status}")


def _placeable(bundle: dict[str, float], ranks: int, strategy: str) -> int:
    """How many of the group's bundles the alive nodes' resources could hold (in all, not free now)."""
    per_node = [min(int(n["Resources"].get(k, 0.0) // v) for k, v in bundle.items() if v)
                for n in ray.nodes() if n.get("Alive")]  # fmt: skip
    if strategy == "STRICT_SPREAD":
        return min(ranks, sum(1 for fit in per_node if fit >= 1))
    if strategy == "STRICT_PACK":
        return min(ranks, max(per_node, default=0))
    return min(ranks, sum(per_node))


def _wait(ref: Any, timeout_s: float, what: str) -> None:
    ready, _ = ray.wait([ref], timeout=timeout_s)
    if not ready:
        raise EngineError(f"{what} could not be placed within {timeout_s:g} s: not enough free CPUs/GPUs")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
