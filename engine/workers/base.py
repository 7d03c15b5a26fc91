"""What every rank actor has: its identity, torch.distributed, the engine version, a health answer."""

from __future__ import annotations

import datetime
import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from engine.errors import NonFiniteError, VersionMismatchError

F = TypeVar("F", bound=Callable[..., Any])


def traced(fn: F) -> F:
    """Record each call of a worker method as a span (method, start, end; wall-clock seconds) for the
    run's timeline (`drain_spans`)."""
    @functools.wraps(fn)
    def call(self: RankWorker, *args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.spans.append((fn.__name__, start, time.time()))
    return call  # type: ignore[return-value]


PARTIAL_UPDATE = -1  # the version of weights that hold part of a failed update


class RankWorker:
    """One process of a worker group. Subclasses add the models; this holds what the group needs.

    `version` is the iteration of the last update applied to the weights (0: none yet). Every call that
    depends on the weights states the version it expects and fails loudly on a mismatch.
    """

    def __init__(self, *, run_id: str, role: str, rank: int, world_size: int, config_hash: str,
                 num_threads: int) -> None:
        self.run_id, self.role, self.rank, self.world_size = run_id, role, rank, world_size
        self.config_hash = config_hash
        self.version = 0
        self.started = time.time()
        self.exit_mid_update = False  # test faults (debug_fault)
        self.stop_mid_update = False
        self.spans: list[tuple[str, float, float]] = []  # traced calls not yet drained
        torch.set_num_threads(max(1, num_threads))

    # -- rendezvous ---------------------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's address and the port of a torch.distributed TCP store it already listens on (bound to
        port 0 here and held until a group takes it: probing for a free port and binding it later raced
        with every other process on the node, which could take the port in between: EADDRINUSE)."""
        host = _node_ip()
        self._rendezvous_store = dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False)
        return host, int(self._rendezvous_store.port)

    def rendezvous_store(self, host: str, port: int, timeout_s: float, *, master: bool) -> dist.Store:
        """The TCP store of a rendezvous: the one `rendezvous_address` holds (the master), or a client."""
        timeout = datetime.timedelta(seconds=timeout_s)
        held = getattr(self, "_rendezvous_store", None)
        if master and held is not None:
            self._rendezvous_store = None
            held.set_timeout(timeout)
            return held
        return dist.TCPStore(host, port, None, is_master=master, timeout=timeout, wait_for_workers=False)

    def init_distributed(self, host: str, port: int, backend: str, timeout_s: float) -> None:
        # One rank still forms a group, so FSDP and the collectives run the same code path.
        dist.init_process_group(
            backend,
            store=self.rendezvous_store(host, port, timeout_s, master=self.rank == 0),
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    # -- health and version ------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "role": self.role,
            "rank": self.rank,
            "world_size": self.world_size,
            "config_hash": self.config_hash,
            "version": self.version,
            "pid": os.getpid(),
            "node_id": _node_id(),
            "uptime_s": round(time.time() - self.started, 1),
        }

    def drain_spans(self) -> list[tuple[str, float, float]]:
        """The spans of the traced calls since the last drain (then forgotten here)."""
        spans, self.spans = self.spans, []
        return spans

    def get_version(self) -> int:
        return self.version

    def peak_rss_bytes(self) -> int:
        """This rank's peak resident memory since its process started (a Ray actor owns its process)."""
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @contextmanager
    def applying_update(self) -> Iterator[None]:
        """Around an update's optimizer steps. One that stops on a non-finite gradient may have stepped on
        earlier mini-batches: its weights are then of no iteration (PARTIAL_UPDATE), so every later call
        that states a version refuses them until the engine restores a checkpoint (flows/train.py)."""
        try:
            yield
        except NonFiniteError:
            self.version = PARTIAL_UPDATE
            raise

    def check_version(self, expected: int | None) -> None:
        if expected is not None and expected != self.version:
            raise VersionMismatchError(
                f"{self.run_id}/{self.role}/{self.rank} holds weights of version {self.version}, "
                f"the call expected version {expected}"
            )

    def collective_trace(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
        """(the result of `method`, every torch.distributed collective it issued on this rank, in order:
        name and tensor shape). For tests: ranks whose traces differ would hang or exchange wrong data."""
        trace: list[str] = []
        originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

        def recording(name: str, fn: Any) -> Any:
            def call(*a: Any, **kw: Any) -> Any:
                shapes = [tuple(x.shape) for x in (*a, *kw.values()) if isinstance(x, torch.Tensor)]
                trace.append(f"{name}{shapes}")
                return fn(*a, **kw)
            return call

        for name, fn in originals.items():
            setattr(dist, name, recording(name, fn))
        try:
            return getattr(self, method)(*args, **kwargs), trace
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def debug_fault(self, kind: str, rank: int, seconds: float = 0.0) -> str:
        """Faults for tests: `raise` on one rank, `hang` for `seconds`, `exit` the process (a crash)."""
        if rank != self.rank:
            return "ok"
        if kind == "raise":
            raise RuntimeError(f"fault injected on rank {rank}")
        if kind == "hang":
            time.sleep(seconds)
            return "woke"
        if kind == "exit":
            os._exit(1)
        if kind == "exit_mid_update":  # armed: the next update exits after its first backward
            self.exit_mid_update = True
            return "armed"
        if kind == "stop_mid_update":  # armed: the next update stops (SIGSTOP) after its first backward
            self.stop_mid_update = True
            return "armed"
        raise ValueError(f"unknown fault kind {kind!r}; allowed: raise, hang, exit, exit_mid_update, "
                         "stop_mid_update")


# What FSDP2 (all_gather_single, reduce_scatter_single in torch >= 2.13; the *_tensor forms before) and
# our own reductions call.
_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                "all_reduce", "all_gather", "broadcast", "reduce_scatter", "barrier")


def _node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())
