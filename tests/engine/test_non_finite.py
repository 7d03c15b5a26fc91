"""A non-finite loss, advantage or gradient fails the update with its reason (issue 47 item 5): the update's
own step function (engine/workers/fsdp.py train_epochs) takes no optimizer step with a NaN gradient, the
worker's weights are then of no version, and the update stage's loader (tasks/stages.py update_inputs)
refuses a stored advantage buffer holding NaN. In one process: no Ray, no engine."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.batch import Batch
from engine.config import OptimConfig
from engine.errors import NonFiniteError
from engine.workers import fsdp
from engine.workers.base import PARTIAL_UPDATE, RankWorker
from infra.buffers import write_buffer
from infra.store import ObjectStore

B, T = 4, 3


def _batch(advantages: torch.Tensor) -> Batch:
    """B rows, T response tokens each: a feature per token and its advantage."""
    g = torch.Generator().manual_seed(0)
    return Batch({"x": torch.randn(B, T, 2, generator=g), "advantages": advantages,
                  "response_mask": torch.ones(B, T, dtype=torch.long),
                  "attention_mask": torch.ones(B, T, dtype=torch.long)}, {})


def _train(advantages: torch.Tensor, mini_batch_size: int) -> tuple[torch.nn.Linear, torch.optim.Optimizer, dict]:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def micro_loss(micro: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        score = model(micro["x"]).squeeze(-1)  # [b, T, 2] -> [b, T]
        loss = -(score * micro["advantages"]).mean()
        return loss, {"actor/pg_loss": loss.detach()}

    cfg = OptimConfig(mini_batch_size=mini_batch_size, micro_batch_size=2)
    fsdp.train_epochs(_batch(advantages), model=model, optimizer=optimizer, cfg=cfg, loss_agg_mode="token-mean",
                      generator=torch.Generator().manual_seed(0), micro_loss=micro_loss,
                      grad_norm_key="actor/grad_norm")
    return model, optimizer, before


def test_finite_advantages_step() -> None:
    model, optimizer, before = _train(torch.ones(B, T), mini_batch_size=B)
    assert not torch.equal(model.weight, before["weight"]) and optimizer.state


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_takes_no_step(bad: float, monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[int] = []
    original = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: steps.append(1) or original(self, *a, **k))
    advantages = torch.ones(B, T)
    advantages[1, 2] = bad
    with pytest.raises(NonFiniteError, match=r"actor/grad_norm is (nan|inf) in epoch 0, mini-batch 0 \(loss "
                                             r"actor/pg_loss (nan|-?inf)\): no optimizer step was taken"):
        _train(advantages, mini_batch_size=B)
    assert steps == []  # AdamW never saw the gradient


def test_a_failed_update_leaves_the_worker_at_no_version() -> None:
    """Mini-batch 0 stepped, mini-batch 1 held the NaN: the weights hold part of an update, so the worker's
    version becomes PARTIAL_UPDATE and the next call that states a version is refused (then restored)."""
    worker = object.__new__(RankWorker)  # the version logic alone: no process group, no threads setting
    worker.run_id, worker.role, worker.rank, worker.version = "run1", "policy", 0, 6
    advantages = torch.ones(B, T)
    advantages[3] = float("nan")
    with pytest.raises(NonFiniteError), worker.applying_update():  # as engine/workers/policy.py wraps it
        _train(advantages, mini_batch_size=1)
    assert worker.version == PARTIAL_UPDATE
    with pytest.raises(Exception, match="holds weights of version -1, the call expected version 6"):
        worker.check_version(6)
    worker.version = 6
    with pytest.raises(ValueError), worker.applying_update():  # any other failure leaves the version alone
        raise ValueError("not a non-finite value")
    assert worker.version == 6


def _stage_ctx(tmp_path: Path) -> tuple[SimpleNamespace, ObjectStore]:
    store = ObjectStore(str(tmp_path / "runs"))
    return SimpleNamespace(store=store), store


def test_the_update_stage_refuses_a_stored_advantage_buffer_with_nan(tmp_path: Path) -> None:
    from tasks.graph import StageSpec
    from tasks.stages import StageResult, update_inputs

    ctx, store = _stage_ctx(tmp_path)
    stage = StageSpec(name="update_policy", task="update_policy", engine=True, writes=(),
                      reads=("advantages", "response_mask"),
                      sources={"compute_advantages": ("advantages", "response_mask")})
    advantages = torch.ones(B, T)
    advantages[2, 1] = float("nan")
    ref = write_buffer(store, "run1", 3, "advantage", _batch(advantages))  # its ref hashes the NaN: it verifies
    with pytest.raises(NonFiniteError, match=r"iteration 3: advantages is not finite in row 2 of .*"
                                             r"iter_000003/advantage.parquet; update_policy refuses it"):
        update_inputs(ctx, 3, stage, {"compute_advantages": StageResult(ref=ref)})
    # NaN under response_mask = 0 is never read by the loss: it passes
    mask = torch.ones(B, T, dtype=torch.long)
    mask[2, 1] = 0
    held = _batch(advantages).with_tensors(response_mask=mask)
    ref = write_buffer(store, "run1", 4, "advantage", held)
    batch = update_inputs(ctx, 4, stage, {"compute_advantages": StageResult(ref=ref)})
    assert torch.equal(batch["response_mask"], mask)


def test_a_non_finite_failure_is_not_retried() -> None:
    """The stage's retry condition: a NaN computes the same NaN again, so the stage fails at once and the
    iteration (then the run) ends Failed; other failures are still retried."""
    from tasks.stages import retry_unless_engine_gone

    def state(err: BaseException) -> SimpleNamespace:
        def result() -> None:
            raise err
        return SimpleNamespace(result=result)

    assert retry_unless_engine_gone(None, None, state(NonFiniteError("rank 0 refused update_actor: nan"))) is False
    assert retry_unless_engine_gone(None, None, state(OSError("transient"))) is True
