"""Rollout correction (engine.algos.correction), computed by hand: truncated and masked importance weights,
per token and per sequence, the gap's metrics, and the corrected loss as advantages times weights."""

from __future__ import annotations

import math

import pytest
import torch

from engine import algos

# The trainer's (proximal) probabilities of three tokens and the rollout's own; the third is masked.
OLD = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]])
ROLLOUT = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.1)]])
MASK = torch.tensor([[1, 1, 0]])


def correct(mode: str, level: str = "token", **bounds: float) -> tuple[torch.Tensor, dict[str, float]]:
    w, stats = algos.rollout_correction(old_logp=OLD, rollout_logp=ROLLOUT, response_mask=MASK, mode=mode,
                                        level=level, **bounds)  # type: ignore[arg-type]
    return w, {k: float(v) for k, v in stats.items()}


def test_token_truncation() -> None:
    w, stats = correct("truncate", upper=1.5)
    # ratios 0.5/0.25 = 2 (truncated to 1.5), 0.2/0.4 = 0.5, the masked token (9) -> 0
    assert torch.allclose(w, torch.tensor([[1.5, 0.5, 0.0]]))
    assert stats["is_weight_mean"] == pytest.approx(1.25)  # (2 + 0.5) / 2, before truncation
    assert stats["is_weight_max"] == pytest.approx(2.0)
    assert stats["corrected_share"] == pytest.approx(0.5)


def test_token_mask() -> None:
    w, stats = correct("mask", upper=1.5, lower=0.6)  # both ratios fall outside [0.6, 1.5]
    assert torch.equal(w, torch.zeros(1, 3))
    assert stats["corrected_share"] == pytest.approx(1.0)
    w, stats = correct("mask", upper=2.0, lower=0.5)  # inside, bounds included: the raw ratios
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 0.0]]))
    assert stats["corrected_share"] == 0.0


def test_sequence_level() -> None:
    two = dict(old_logp=torch.cat([OLD, OLD]), rollout_logp=torch.cat([ROLLOUT, OLD]),
               response_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
    w, stats = algos.rollout_correction(**two, mode="truncate", level="sequence", upper=3.0)
    # row 0: 2 x 0.5 = 1 (the masked token left out); row 1: the rollout agrees, 1; every token carries it
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    w, stats = algos.rollout_correction(old_logp=OLD, rollout_logp=ROLLOUT, response_mask=torch.tensor([[1, 0, 0]]),
                                        mode="truncate", level="sequence", upper=1.5)
    assert torch.allclose(w, torch.tensor([[1.5, 0.0, 0.0]]))  # 2, truncated
    assert float(stats["is_weight_mean"]) == pytest.approx(2.0) and float(stats["corrected_share"]) == 1.0
    w, _ = algos.rollout_correction(old_logp=OLD, rollout_logp=ROLLOUT, response_mask=torch.tensor([[1, 0, 0]]),
                                    mode="mask", level="sequence", upper=1.5, lower=0.5)
    assert torch.equal(w, torch.zeros(1, 3))  # the whole response is masked


def test_gap_metrics() -> None:
    _, stats = correct("truncate")
    r = [math.log(2.0), math.log(0.5)]  # old - rollout on the two response tokens
    assert stats["log_ppl_diff"] == pytest.approx(sum(r) / 2)  # mean token log-prob gap of the one response
    assert stats["kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in r) / 2)  # (0.307 + 0.193) / 2
    assert stats["outside_share"] == 0.0  # 2 and 0.5 are on the band's edges, inside
    same = algos.rollout_correction(old_logp=OLD, rollout_logp=OLD, response_mask=MASK, mode="truncate")[1]
    assert float(same["kl_k3"]) == 0.0 and float(same["log_ppl_diff"]) == 0.0 and float(same["is_weight_mean"]) == 1.0
    far = algos.rollout_correction(old_logp=OLD, rollout_logp=OLD - 1.0, response_mask=MASK, mode="truncate")[1]
    assert float(far["outside_share"]) == 1.0  # e = 2.72 > 2 on both tokens


def test_the_corrected_loss_is_the_surrogate_weighted() -> None:
    """The decoupled loss is w x the clipped surrogate of pi / pi_prox: with the advantages scaled by w,
    ppo_clip gives exactly that, token by token (here: ratio 1.1 against the proximal policy)."""
    w, _ = correct("truncate", upper=1.5)
    logp = OLD + math.log(1.1)
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    loss, _ = algos.ppo_clip(logp=logp, old_logp=OLD, adv=adv * w, response_mask=MASK, clip_low=0.2, clip_high=0.2,
                             loss_agg_mode="token-mean")
    by_hand = (1.5 * -(1.0 * 1.1) + 0.5 * -(-2.0 * 1.1)) / 2  # both ratios inside the clip range
    assert float(loss) == pytest.approx(by_hand)
