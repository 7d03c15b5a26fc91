"""FSDP2 plumbing shared by the policy and critic ranks: sharding, optimizer, LR schedule, state.

FSDP2 (`fully_shard`) is used because it trains on CPU with gloo; FSDP1 needs an accelerator and
segfaults gathering with CPU offload (seen when it was written, not re-measured: docs/architecture.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from engine import algos
from engine.batch import Batch, response_lengths
from engine.config import OptimConfig
from engine.errors import NonFiniteError
from engine.state import checkpoint_io


def shard_model(model: nn.Module, reshard_after_forward: bool = True, mixed_precision: str = "none",
                cpu_offload: bool = False, gradient_checkpointing: bool = False) -> nn.Module:
    """FSDP2 per decoder layer, then the root (embeddings, final norm, head).

    mixed_precision "bf16": FSDP2's MixedPrecisionPolicy, bf16 parameters for forward and backward,
    gradients reduced in fp32; the sharded (master) parameters, hence the optimizer state, are fp32.
    cpu_offload: FSDP2's CPUOffloadPolicy when the model is on an accelerator; a model on the CPU has its
    parameters, gradients and optimizer state in host memory already (FSDP2 refuses the policy there),
    so there it is nothing to do. gradient_checkpointing: transformers' own, per decoder layer (it
    recomputes `forward` inside FSDP2's hooks), non-reentrant.
    """
    options: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mixed_precision == "bf16":
        model.float()  # master weights in fp32 whatever the checkpoint's dtype
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mixed_precision != "none":
        raise ValueError(f"mixed_precision {mixed_precision!r}: allowed: none, bf16")
    if cpu_offload and next(model.parameters()).device.type != "cpu":
        options["offload_policy"] = CPUOffloadPolicy()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def shard_options(cfg: OptimConfig) -> dict[str, Any]:
    """shard_model's keyword arguments from an actor or critic config."""
    return {"reshard_after_forward": cfg.reshard_after_forward, "mixed_precision": cfg.mixed_precision,
            "cpu_offload": cfg.cpu_offload, "gradient_checkpointing": cfg.gradient_checkpointing}


@contextmanager
def gathered(model: nn.Module, reshard_after_forward: bool = True) -> Iterator[nn.Module]:
    """`model`'s parameters all-gathered once (the same collectives on every rank) and kept unsharded
    until the block ends: forward passes inside issue no collective, so ranks may run different numbers
    of them (a decode loop whose rows end at different steps). Resharded at the end, and
    `reshard_after_forward` (what the model was sharded with) set again."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_reshard_after_forward(False)
    try:
        for module in modules:
            module.unshard()
        yield model
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(reshard_after_forward)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM (Llama, Qwen2, Mistral, GPT-2...)."""
    for attr in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        node: Any = model
        for part in attr.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, nn.ModuleList):
            return list(node)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach=False: the foreach kernels do not take DTensor shards on every backend.
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, foreach=False)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over `warmup_steps` updates, then constant, cosine or linear decay to min_lr_ratio."""
    warmup, floor, kind = cfg.warmup_steps, cfg.min_lr_ratio, cfg.lr_schedule
    decay_steps = max(1, total_steps - warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / decay_steps)
        if kind == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if kind == "linear":
            return floor + (1 - floor) * (1 - progress)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global grad norm over all shards (a DTensor under FSDP2), clipped in place; returns a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def full_state_dict(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Every rank gets the full (unsharded) weights: an all-gather, called on every rank.
    `trainable_only`: the parameters that train (LoRA: the adapters), each gathered alone; nothing
    frozen is gathered."""
    if trainable_only:
        return gather_full([(name, p) for name, p in model.named_parameters() if p.requires_grad])
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def gather_full(params: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full tensors of FSDP2 parameters (DTensors sharded on dim 0, as torch.chunk splits it) with
    ONE all-gather: each rank's shards padded to the chunk size, flattened and concatenated. The
    adapters of a LoRA model are ~100 small tensors, and one collective each would cost more than the
    bytes (gloo: ~2 ms per call). Parameters of mixed dtypes or other placements: one gather each."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dtypes = {p.dtype for _, p in params}
    if world == 1 or len(dtypes) != 1 or not all(_sharded_dim0(p) for _, p in params):
        return {name: _full(p).detach().clone() for name, p in params}
    pieces, layouts = [], []
    for _, p in params:
        rows = p.shape[0]
        sizes = [len(c) for c in torch.arange(rows).chunk(world)]
        sizes += [0] * (world - len(sizes))
        per = max(sizes)
        local = p.to_local().detach()  # type: ignore[attr-defined]
        padded = torch.zeros((per, *p.shape[1:]), dtype=p.dtype)
        padded[: local.shape[0]] = local
        pieces.append(padded.reshape(-1))
        layouts.append((per, sizes))
    flat = torch.cat(pieces)
    out = torch.empty(world * flat.numel(), dtype=flat.dtype)
    dist.all_gather_into_tensor(out, flat)
    gathered = out.view(world, -1)
    result, offset = {}, 0
    for (name, p), piece, (per, sizes) in zip(params, pieces, layouts):
        chunks = gathered[:, offset: offset + piece.numel()].reshape(world, per, *p.shape[1:])
        result[name] = torch.cat([chunks[r, : sizes[r]] for r in range(world)]).clone()
        offset += piece.numel()
    return result


def stream_full(model: nn.Module, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full weights as (transformers name, tensor) pairs, gathered from the shards a bucket at a
    time as they are consumed (one all-gather per bucket, the same on every rank, in parameter order): no
    full state dict is built. LoRA layers come merged, W + scaling * B @ A under the base weight's name,
    their adapters not sent (the adapters, small, are gathered first)."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    adapters = gather_full([(n, p) for n, p in model.named_parameters() if ".lora_" in n]) if layers else {}
    params = [(n, p) for n, p in model.named_parameters() if ".lora_" not in n]

    def merged(name: str, full: torch.Tensor) -> tuple[str, torch.Tensor]:
        owner, _, rest = name.partition(".base_layer.")
        if not rest:
            return name, full
        layer = layers[owner]
        if rest == "weight":
            delta = adapters[f"{owner}.lora_B.default.weight"].float() @ adapters[f"{owner}.lora_A.default.weight"].float()
            delta = delta * layer.scaling["default"]
            full = (full.float() + (delta.T if getattr(layer, "fan_in_fan_out", False) else delta)).to(full.dtype)
        return f"{owner}.{rest}", full

    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for i, (name, p) in enumerate(params):
        bucket.append((name, p))
        size += p.numel() * p.element_size()
        if size >= bucket_bytes or i == len(params) - 1:
            for key, full in gather_full(bucket).items():
                yield merged(key, full)
            bucket, size = [], 0


def _sharded_dim0(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(t, DTensor) and len(t.placements) == 1 and t.placements[0] == Shard(0)


def full_state_dict_rank0(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Rank 0 gets the full weights on CPU, the others an empty dict; called on every rank."""
    if trainable_only:
        state = full_state_dict(model, trainable_only=True)
        return {k: v.cpu() for k, v in state.items()} if dist.get_rank() == 0 else {}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _trainable_only(model: nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    """`model_sd` without the frozen parameters' entries. torch's ignore_frozen_params misses a frozen
    weight tied to another (a tied output head: `lm_head.weight`), which would put the embedding matrix
    in every LoRA checkpoint."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}


def save_sharded(url: str, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any],
                 storage_options: dict[str, Any], trainable_only: bool = False) -> list[checkpoint_io.FileRecord]:
    """Model + optimizer shards into `url` (a folder or s3:// prefix), plus this rank's small state
    (`extra`: scheduler, RNG, version); returns the files this rank wrote, hashed while written.
    `trainable_only` (LoRA): the frozen base weights are left out, the checkpoint holds what trains."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=trainable_only))
    if trainable_only:
        model_sd = _trainable_only(model, model_sd)
    return checkpoint_io.save(url, {"model": model_sd, "optim": optim_sd}, extra, storage_options, dist.get_rank())


def load_sharded(url: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 storage_options: dict[str, Any], expected: dict[str, tuple[int, str]] | None = None,
                 trainable_only: bool = False) -> dict[str, Any]:
    """Inverse of save_sharded, every file verified against `expected` (the manifest) as it is read;
    returns this rank's `extra`. `trainable_only`: the checkpoint holds the trainable parameters only,
    the frozen ones keep the values they were loaded with (the base model's)."""
    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model, options=options)}
    if trainable_only:
        state["model"] = _trainable_only(model, state["model"])
    extra = checkpoint_io.load(url, state, storage_options, dist.get_rank(), expected)
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
    else:
        model.load_state_dict(state["model"], strict=not trainable_only)
    return extra


def rng_state() -> dict[str, Any]:
    import random

    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


MicroLoss = Callable[[Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def train_epochs(batch: Batch, *, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                 loss_agg_mode: str, generator: torch.Generator, micro_loss: MicroLoss, grad_norm_key: str,
                 after_backward: Callable[[], None] | None = None, group_prompts: bool = False
                 ) -> dict[str, torch.Tensor]:
    """PPO epochs over this rank's shard: shuffled mini-batches (one optimizer step each) whose
    gradients `accumulate_gradients` builds. Returns the mean of every stat over the optimizer steps
    (this rank's view; all_reduce_mean averages ranks)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mini = max(1, cfg.mini_batch_size // world)  # rows of this rank per optimizer step
    stats: dict[str, list[torch.Tensor]] = {}
    for epoch in range(cfg.ppo_epochs):
        for i, minibatch in enumerate(batch.shuffle(generator).chunks(mini)):
            step = accumulate_gradients(minibatch, model=model, cfg=cfg, loss_agg_mode=loss_agg_mode,
                                        micro_loss=micro_loss, after_backward=after_backward,
                                        group_prompts=group_prompts)
            grad_norm = clip_grad_norm(model, cfg.grad_clip)
            # The norm is global (the same on every rank), so every rank stops here together. A non-finite
            # loss gives a non-finite gradient: both are caught before the step that would spread them.
            if not torch.isfinite(grad_norm):
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(f"{grad_norm_key} is {float(grad_norm)} in epoch {epoch}, mini-batch {i} (loss "
                                     f"{_loss_text(step)}): no optimizer step was taken with it")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step[grad_norm_key] = grad_norm.detach()
            for key, value in step.items():
                stats.setdefault(key, []).append(value)
    return {k: torch.stack(v).mean() for k, v in stats.items()}


def _loss_text(step: dict[str, torch.Tensor]) -> str:
    """This rank's loss values of a mini-batch, for the error that names a non-finite gradient."""
    losses = {k: float(v) for k, v in step.items() if k.endswith("loss")}
    return ", ".join(f"{k} {v:.4g}" for k, v in sorted(losses.items())) or "not recorded"


def accumulate_gradients(minibatch: Batch, *, model: nn.Module, cfg: OptimConfig, loss_agg_mode: str,
                         micro_loss: MicroLoss, after_backward: Callable[[], None] | None = None,
                         group_prompts: bool = False) -> dict[str, torch.Tensor]:
    """Backward of this rank's part of one global mini-batch, micro-batch by micro-batch, each
    loss weighted (micro_weights) so that the accumulated gradient, averaged over the ranks by FSDP,
    is the gradient of the loss aggregated over the whole global mini-batch. Returns the stats
    weighted the same way (this rank's share of the mini-batch value)."""
    plan = plan_micro_batches(minibatch, max_rows=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_micro_batch,
                              packed=cfg.packed_sequences, group_prompts=group_prompts)
    micros = [micro_batch(minibatch, rows) for rows in plan]
    once = cfg.grad_sync == "optimizer_step"
    step: dict[str, torch.Tensor] = {}
    for i, (micro, weight) in enumerate(zip(micros, micro_weights(micros, loss_agg_mode))):
        if once and isinstance(model, FSDPModule):  # reduce-scatter with the last micro-batch only
            model.set_requires_gradient_sync(i == len(micros) - 1)
        loss, micro_stats = micro_loss(micro)
        (loss * weight).backward()  # gradient accumulation, weighted to the global mini-batch
        if after_backward is not None:
            after_backward()
        for key, value in micro_stats.items():
            step[key] = step.get(key, torch.zeros(())) + value.detach() * weight
    return step


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """The accumulated gradient of every parameter, unsharded (an all-gather per parameter; every
    rank calls it): what the optimizer step would see, before clipping."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            grads[name] = torch.zeros(param.shape, dtype=param.dtype)
            continue
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return grads


def plan_micro_batches(batch: Batch, *, max_rows: int, max_tokens: int | None = None, packed: bool = False,
                       group_prompts: bool = False) -> list[list[int]]:
    """This rank's micro-batches of `batch`, as row indices: rows in length order (see `length_order`),
    at most `max_rows` per micro-batch and, with a token budget, at most `max_tokens` tokens as the
    forward processes them (padded: rows x the longest row; packed: the sum of the rows); a row longer
    than the budget is a micro-batch of its own. Then as many micro-batches as the rank with the most:
    every forward all-gathers under FSDP2, so the ranks' counts must agree; the missing ones are empty
    lists (`micro_batch` makes them a row with no response token, whose loss weighs 0)."""
    if len(batch) == 0:
        order: list[int] = []
    elif "response_mask" in batch:
        order = length_order(batch, group_prompts).tolist()
    else:
        order = list(range(len(batch)))
    plans: list[list[int]] = []
    if max_tokens is None:
        plans = [order[i:i + max_rows] for i in range(0, len(order), max_rows)]
    else:
        tokens = row_tokens(batch)
        current: list[int] = []
        longest = total = 0
        for row in order:
            cost_if_added = total + tokens[row] if packed else (len(current) + 1) * max(longest, tokens[row])
            if current and (len(current) == max_rows or cost_if_added > max_tokens):
                plans.append(current)
                current, longest, total = [], 0, 0
            current.append(row)
            longest, total = max(longest, tokens[row]), total + tokens[row]
        if current:
            plans.append(current)
    count = int(global_max(len(plans)))
    return plans + [[] for _ in range(count - len(plans))]


def row_tokens(batch: Batch) -> list[int]:
    """Real tokens of each row: its prompt's and its response's (`attention_mask` covers both)."""
    return [int(n) for n in batch["attention_mask"].sum(-1).tolist()]


def micro_batch(batch: Batch, rows: list[int]) -> Batch:
    """The rows of a micro-batch; no rows: the first row with its response masked out (a forward and
    backward that count for nothing, so that this rank issues the collectives its peers do)."""
    if rows:
        return batch.index(rows)
    empty = batch.index([0])
    return empty.with_tensors(response_mask=torch.zeros_like(empty["response_mask"]))


def global_max(value: float) -> float:
    """Maximum of a number over the ranks (one collective)."""
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def length_order(batch: Batch, group_prompts: bool) -> torch.Tensor:
    """Row order by response length (stable). With `group_prompts`, rows with the same prompt stay
    together, groups ordered by their longest response, so that a micro-batch holds whole groups whose
    prompt runs once (policy.response_logits)."""
    lengths = response_lengths(batch)
    if not group_prompts or len(lengths) == 0:
        return torch.argsort(lengths, stable=True)
    unique, group = prompt_groups(batch)
    longest = torch.zeros(len(unique), dtype=lengths.dtype).scatter_reduce(0, group, lengths, "amax")
    span = batch["responses"].shape[1] + 1  # lengths are 0..T
    key = (longest[group] * len(unique) + group) * span + lengths
    return torch.argsort(key, stable=True)


def prompt_groups(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distinct prompts [U, P] of `batch`'s rows, each row's index into them [B]): rows answering
    the same prompt (a GRPO group) share an index. The prompt is `input_ids` before the responses."""
    t = batch["responses"].shape[1]
    prompts = batch["input_ids"][:, : batch["input_ids"].shape[1] - t]
    return torch.unique(prompts, dim=0, return_inverse=True)


def global_sum(value: float) -> float:
    """Sum of a number over the ranks (one collective)."""
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def micro_weights(micros: list[Any], loss_agg_mode: str) -> list[float]:
    """Weight of each micro-batch's aggregated loss so that, summed over micro-batches and averaged over
    ranks (FSDP averages gradients), the mini-batch loss is the aggregate over the GLOBAL mini-batch:
    units(micro) / units(global mini-batch) * world, with the units of the mode's own aggregate
    (algos.agg_units: tokens for token-mean, non-empty sequences for the seq-* modes). Sharded training
    then equals one process whatever the micro-batch size, the short last chunk or the world size."""
    local = [float(algos.agg_units(loss_mask=m["response_mask"], loss_agg_mode=loss_agg_mode)) for m in micros]
    total = global_sum(sum(local))
    world = dist.get_world_size() if dist.is_initialized() else 1
    return [u * world / total if total > 0 else 0.0 for u in local]


def all_reduce_mean(values: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """Average named scalars over the ranks with one collective and one sync; Python floats out."""
    keys = sorted(values)
    if not keys:
        return {}
    stacked = torch.stack([torch.as_tensor(values[k], dtype=torch.float64).detach().cpu() for k in keys])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        stacked /= dist.get_world_size()
    return dict(zip(keys, stacked.tolist()))
