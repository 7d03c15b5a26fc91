"""Weights from the training pool to the rollout pool (placement.mode=split), over a collective group
that spans both: the training group's rank 0 and every rollout rank, in buckets.

    group = join_sync_group(store, rank, world_size, timeout_s)    # once per engine start, every member
    send(group, state, bucket_bytes)                                # training rank 0: the full weights
    receive(group, targets, bucket_bytes)                           # every rollout rank, into its model

Both sides plan the same buckets from the same (name, shape) list, sorted by name, so no tensor list
travels: the sender first broadcasts the plan's digest, and a receiver whose model has other names or
shapes fails before any weight is written. Each bucket is one broadcast of a flat float32 buffer. The
rollout's `version` is set by its worker only after `receive` returns, i.e. when all of it arrived.
gloo on CPU; nccl is the GPU path (not built: the engine refuses GPU runs).
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

Entry = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class SyncGroup:
    """A process group of its own (not the worker group's default one): sender rank 0, receivers 1..R."""

    group: dist.ProcessGroup
    rank: int
    world_size: int


def join_sync_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> SyncGroup:
    """Join the sync group; every member calls it at once (it returns when all have joined). `store`:
    the group's TCP store, hosted by rank 0 (see BaseWorker.rendezvous_store)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    group = dist.ProcessGroupGloo(dist.PrefixStore("rlflow-weight-sync", store), rank, world_size, timeout)
    return SyncGroup(group, rank, world_size)


def bucket_plan(entries: list[Entry], bucket_bytes: int) -> list[list[Entry]]:
    """The entries sorted by name, cut into buckets of at most `bucket_bytes` of float32 (a tensor larger
    than a bucket gets a bucket of its own)."""
    buckets: list[list[Entry]] = [[]]
    size = 0
    for name, shape in sorted(entries):
        nbytes = 4 * _numel(shape)
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, shape))
        size += nbytes
    return [b for b in buckets if b]


def plan_digest(plan: list[list[Entry]]) -> int:
    """A 63-bit digest of the plan (names, shapes, bucket cuts): what sender and receivers compare."""
    text = repr(plan).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def send(group: SyncGroup, state: dict[str, torch.Tensor], bucket_bytes: int) -> int:
    """Broadcast `state` (full tensors) to the receivers, bucket by bucket; returns the bytes sent."""
    plan = bucket_plan([(k, tuple(v.shape)) for k, v in state.items()], bucket_bytes)
    _broadcast(group, torch.tensor([plan_digest(plan), len(plan)], dtype=torch.int64))
    sent = 0
    for bucket in plan:
        flat = torch.cat([state[name].detach().reshape(-1).float() for name, _ in bucket])
        _broadcast(group, flat)
        sent += flat.numel() * 4
    return sent


def receive(group: SyncGroup, targets: dict[str, torch.Tensor], bucket_bytes: int,
            after_bucket: object = None) -> int:
    """Receive the broadcast buckets into `targets` (tensors written in place, cast to their dtype);
    returns the bytes received. RuntimeError, before anything is written, when the sender's plan is
    not this model's. `after_bucket(i)`: called after bucket i is written (a test's fault hook)."""
    received = 0
    with torch.no_grad():
        for name, tensor in receive_stream(group, [(k, tuple(v.shape)) for k, v in targets.items()], bucket_bytes,
                                           after_bucket):
            targets[name].copy_(tensor)
            received += tensor.numel() * 4
    return received


def receive_stream(group: SyncGroup, entries: list[Entry], bucket_bytes: int,
                   after_bucket: object = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The broadcast weights as (name, float32 tensor) pairs, a bucket received each time the last one's
    tensors have been taken (a vLLM engine loads them as they come: no full copy is assembled). The
    sender's plan is checked against `entries` first, RuntimeError before any weight is yielded.
    `after_bucket(i)`: called once bucket i's tensors have all been taken."""
    plan = bucket_plan(entries, bucket_bytes)
    header = torch.zeros(2, dtype=torch.int64)
    _broadcast(group, header)
    if int(header[0]) != plan_digest(plan) or int(header[1]) != len(plan):
        raise RuntimeError(f"weight sync: the training pool sends {int(header[1])} buckets of another plan than "
                           f"this rollout model's {len(plan)} (different weight names or shapes)")
    for i, bucket in enumerate(plan):
        flat = torch.empty(sum(_numel(shape) for _, shape in bucket), dtype=torch.float32)
        _broadcast(group, flat)
        offset = 0
        for name, shape in bucket:
            n = _numel(shape)
            yield name, flat[offset:offset + n].view(shape)
            offset += n
        if callable(after_bucket):
            after_bucket(i)


def tied_duplicates(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are another parameter (a tied output head): sent once, by the other name."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return every - {name for name, _ in model.named_parameters()}


def _broadcast(group: SyncGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.group.broadcast([tensor], opts).wait()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
