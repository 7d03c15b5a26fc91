"""CriticWorker: a value model (the LM trunk with a scalar head per token) under FSDP2, for PPO/GAE."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine import algos
from engine.batch import Batch
from engine.models import lora
from engine.models.loading import dropout_left, load_value_model
from engine.models.tokens import packed_inputs, positions
from engine.seeds import derive_seed
from engine.workers import fsdp
from engine.workers.base import RankWorker, traced
from engine.workers.specs import CriticSpec


class CriticWorker(RankWorker):
    def __init__(self, *, spec: dict[str, Any], **identity: Any) -> None:
        super().__init__(**identity)
        self.spec = CriticSpec.model_validate(spec)

    def setup(self) -> None:
        spec = self.spec
        torch.manual_seed(derive_seed(spec.seed, 0, "critic_head"))  # the new value head's init
        model = load_value_model(spec.model_path, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code)
        self.lora = spec.critic.lora.enabled  # LoRA: adapters on the trunk, the value head trained in full
        if self.lora:
            model, _ = lora.apply_lora(model, spec.critic.lora, task="TOKEN_CLS", what="critic.lora")
        self.model = fsdp.shard_model(model, **fsdp.shard_options(spec.critic))
        self.optimizer = fsdp.build_optimizer(self.model, spec.critic)
        self.scheduler = fsdp.build_scheduler(self.optimizer, spec.critic, spec.total_iterations)

    @torch.no_grad()
    @traced
    def compute_values(self, batch: Batch, *, expected_version: int | None) -> Batch:
        """`values` [B, T]: the value of the state before each response token."""
        self.check_version(expected_version)
        self.model.eval()
        cfg = self.spec.critic
        values = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        for rows in fsdp.plan_micro_batches(batch, max_rows=cfg.micro_batch_size, packed=cfg.packed_sequences,
                                            max_tokens=cfg.max_tokens_per_micro_batch):
            out = response_values(self.model, fsdp.micro_batch(batch, rows), cfg.packed_sequences)
            if rows:  # an empty micro-batch runs for the collectives only
                values[rows] = out
        return Batch({"values": values}, {})

    @traced
    def update_critic(self, batch: Batch, *, iteration: int, expected_version: int | None) -> dict[str, float]:
        """Clipped value regression on `returns` (needs `values`, `returns`, `response_mask`)."""
        self.check_version(expected_version)
        cfg = self.spec.critic
        gen = torch.Generator().manual_seed(derive_seed(self.spec.seed, iteration, "update_critic", self.rank))
        self.model.train()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this update's optimizer steps use
        with self.applying_update():
            local = fsdp.train_epochs(batch, model=self.model, optimizer=self.optimizer, cfg=cfg,
                                      loss_agg_mode=cfg.loss_agg_mode, generator=gen, micro_loss=self._micro_loss,
                                      grad_norm_key="critic/grad_norm")
        self.scheduler.step()
        self.version = iteration
        local["critic/lr"] = torch.tensor(lr)
        return fsdp.all_reduce_mean(local)

    def gradients(self, batch: Batch, *, micro_batch_size: int | None = None, loss_agg_mode: str | None = None,
                  max_tokens_per_micro_batch: int | None = None) -> dict[str, torch.Tensor]:
        """The gradient of the value loss on `batch` as one mini-batch, before clipping (as PolicyWorker's)."""
        critic = self.spec.critic.model_copy(update={
            "micro_batch_size": micro_batch_size or self.spec.critic.micro_batch_size,
            "loss_agg_mode": loss_agg_mode or self.spec.critic.loss_agg_mode,
            "max_tokens_per_micro_batch": max_tokens_per_micro_batch or self.spec.critic.max_tokens_per_micro_batch})
        saved, self.spec = self.spec, self.spec.model_copy(update={"critic": critic})
        try:
            self.model.train()
            self.optimizer.zero_grad(set_to_none=True)
            fsdp.accumulate_gradients(batch, model=self.model, cfg=critic, loss_agg_mode=critic.loss_agg_mode,
                                      micro_loss=self._micro_loss)
            return fsdp.full_gradients(self.model)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.spec = saved

    def _micro_loss(self, micro: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = algos.clipped_value_loss(
            vpreds=response_values(self.model, micro, self.spec.critic.packed_sequences), values=micro["values"],
            returns=micro["returns"],
            response_mask=micro["response_mask"], clip_range_value=self.spec.critic.clip_range_value,
            loss_agg_mode=self.spec.critic.loss_agg_mode, max_response_length=self.spec.max_response_length,
        )
        return loss, {"critic/vf_loss": loss.detach(), **{f"critic/{k}": v for k, v in stats.items()}}

    def dropout_left(self) -> dict[str, list[str]]:
        return {"critic": dropout_left(self.model)}

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full value-model weights on rank 0 (empty on the others); every rank joins the gather."""
        return fsdp.full_state_dict_rank0(self.model)

    @traced
    def save(self, url: str, storage_options: dict[str, Any]) -> list[dict[str, Any]]:
        extra = {"scheduler": self.scheduler.state_dict(), "rng": fsdp.rng_state(), "version": self.version}
        return fsdp.save_sharded(url, self.model, self.optimizer, extra, storage_options, trainable_only=self.lora)

    @traced
    def load(self, url: str, storage_options: dict[str, Any], expected: dict[str, tuple[int, str]] | None = None
             ) -> int:
        extra = fsdp.load_sharded(url, self.model, self.optimizer, storage_options, expected,
                                  trainable_only=self.lora)
        self.scheduler.load_state_dict(extra["scheduler"])
        fsdp.set_rng_state(extra["rng"])
        self.version = int(extra["version"])
        return self.version


def response_values(model: nn.Module, batch: Batch, packed: bool = False) -> torch.Tensor:
    """[B, P+T] inputs -> values [B, T]: the output at position j values the state that emits token j+1.
    `packed`: the rows run as one sequence without padding (models.packed_inputs)."""
    if packed:
        t = batch["responses"].shape[1]
        ids, pos, index = packed_inputs(batch, t)
        out = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits[0, :, 0]  # [N]
        return out[index].float()  # [B, T]; past a row's response: its last position's (masked by the loss)
    attention_mask = batch["attention_mask"]
    position_ids = positions(attention_mask)
    t = batch["responses"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=attention_mask, position_ids=position_ids).logits
    return out[:, -t - 1 : -1, 0].float()  # [B, P+T, 1] -> [B, T]
