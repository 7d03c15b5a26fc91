"""algorithm.ipo_logratio reaches the update: PolicyWorker._pair_loss (the DPO/IPO update's loss of a micro-batch)
on one pair, its log-ratios summed or averaged over each response's tokens, against the loss by hand. One
process, a bigram table in place of the FSDP actor (as tests/engine/test_correction_update.py)."""

from __future__ import annotations

import pytest
import torch

from engine.batch import Batch
from engine.workers.policy import PolicySpec, PolicyWorker
from tests.engine.bigram import Bigram

V, PAD, BETA = 8, 0, 0.1




def side(responses: list[int], mask: list[int]) -> dict[str, torch.Tensor]:
    r = torch.tensor([responses])
    return {"input_ids": torch.cat([torch.tensor([[1]]), r], dim=1),
            "attention_mask": torch.tensor([[1, *mask]]), "responses": r, "response_mask": torch.tensor([mask])}


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_the_pair_loss_reads_ipo_logratio(reduce: str) -> None:
    spec = PolicySpec(model_path="unused", tokenizer_path="unused", objective="dpo", dpo_loss="ipo", dpo_beta=BETA,
                      ipo_logratio=reduce, actor={"share_prompts": False})
    worker = PolicyWorker(spec=spec.model_dump(), run_id="t", role="policy", rank=0, world_size=1, config_hash="t",
                          num_threads=torch.get_num_threads())
    worker.actor = Bigram(V, 1)
    chosen, rejected = side([2, 3, PAD], [1, 1, 0]), side([4, 5, 6], [1, 1, 1])
    ref_c, ref_r = torch.tensor([[-1.0, -3.0, -9.0]]), torch.tensor([[-2.0, -1.5, -2.5]])
    micro = Batch({**chosen, **{f"rejected_{k}": v for k, v in rejected.items()}, "ref_logp": ref_c,
                   "rejected_ref_logp": ref_r}, {})
    loss, stats = worker._pair_loss(micro)

    logp = torch.log_softmax(worker.actor.table.detach(), -1)  # [V, V]: row = the token read, column = the next
    h_c = [float(logp[1, 2]) + 1.0, float(logp[2, 3]) + 3.0]  # policy - reference on the two chosen tokens
    h_r = [float(logp[1, 4]) + 2.0, float(logp[4, 5]) + 1.5, float(logp[5, 6]) + 2.5]
    margin = sum(h_c) / len(h_c) - sum(h_r) / len(h_r) if reduce == "mean" else sum(h_c) - sum(h_r)
    assert float(loss.detach()) == pytest.approx((margin - 1 / (2 * BETA)) ** 2, rel=1e-6)
    assert float(stats["actor/rewards/margin"]) == pytest.approx(BETA * margin, rel=1e-6)
