"""DPO's and IPO's losses on a small case computed by hand, their gradients, and the implicit rewards."""

import math

import pytest
import torch

from engine.algos import preference_loss, sequence_logp

# two pairs: log-likelihood sums of the policy and the reference
CHOSEN, REJECTED = torch.tensor([-2.0, -5.0]), torch.tensor([-3.0, -4.0])
REF_CHOSEN, REF_REJECTED = torch.tensor([-2.5, -4.0]), torch.tensor([-2.0, -4.5])
BETA = 0.1


def test_sigmoid_dpo_by_hand() -> None:
    # pair 0: h_c = -2 - -2.5 = 0.5, h_r = -3 - -2 = -1: margin 1.5, loss -log sigmoid(0.15)
    # pair 1: h_c = -5 - -4 = -1, h_r = -4 - -4.5 = 0.5: margin -1.5, loss -log sigmoid(-0.15)
    losses, stats = preference_loss(chosen_logp=CHOSEN, rejected_logp=REJECTED, ref_chosen_logp=REF_CHOSEN,
                                    ref_rejected_logp=REF_REJECTED, beta=BETA, kind="sigmoid")
    want = [math.log(1 + math.exp(-0.15)), math.log(1 + math.exp(0.15))]
    assert losses.tolist() == pytest.approx(want, abs=1e-7)
    assert stats["rewards/chosen"].tolist() == pytest.approx([0.05, -0.1])
    assert stats["rewards/rejected"].tolist() == pytest.approx([-0.1, 0.05])
    assert stats["rewards/margin"].tolist() == pytest.approx([0.15, -0.15])
    assert stats["rewards/accuracy"].tolist() == [1.0, 0.0]


def test_ipo_by_hand() -> None:
    # (h_c - h_r - 1 / (2 beta))^2 = (1.5 - 5)^2 and (-1.5 - 5)^2
    losses, _ = preference_loss(chosen_logp=CHOSEN, rejected_logp=REJECTED, ref_chosen_logp=REF_CHOSEN,
                                ref_rejected_logp=REF_REJECTED, beta=BETA, kind="ipo")
    assert losses.tolist() == pytest.approx([12.25, 42.25])


def test_gradients_push_the_chosen_up_and_the_rejected_down() -> None:
    """d/d logp_c of -log sigmoid(beta m) is -beta sigmoid(-beta m); of IPO's, 2 (m - 1/(2 beta))."""
    chosen, rejected = CHOSEN.clone().requires_grad_(), REJECTED.clone().requires_grad_()
    losses, _ = preference_loss(chosen_logp=chosen, rejected_logp=rejected, ref_chosen_logp=REF_CHOSEN,
                                ref_rejected_logp=REF_REJECTED, beta=BETA, kind="sigmoid")
    losses.sum().backward()
    sig = [1 / (1 + math.exp(0.15)), 1 / (1 + math.exp(-0.15))]  # sigmoid(-beta m)
    assert chosen.grad.tolist() == pytest.approx([-BETA * s for s in sig])
    assert rejected.grad.tolist() == pytest.approx([BETA * s for s in sig])
    chosen.grad = None
    losses, _ = preference_loss(chosen_logp=chosen, rejected_logp=rejected, ref_chosen_logp=REF_CHOSEN,
                                ref_rejected_logp=REF_REJECTED, beta=BETA, kind="ipo")
    losses.sum().backward()
    assert chosen.grad.tolist() == pytest.approx([2 * (1.5 - 5), 2 * (-1.5 - 5)])


def test_sequence_logp_sums_the_trained_tokens_only() -> None:
    logp = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -0.25, -8.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    assert sequence_logp(logp, mask).tolist() == [-5.0, -0.75]


def test_an_unknown_loss_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown preference loss 'hinge'; allowed: sigmoid, ipo"):
        preference_loss(chosen_logp=CHOSEN, rejected_logp=REJECTED, ref_chosen_logp=REF_CHOSEN,
                        ref_rejected_logp=REF_REJECTED, beta=BETA, kind="hinge")  # type: ignore[arg-type]


def test_sequence_logp_mean_divides_by_the_trained_tokens() -> None:
    logp = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -0.25, -8.0], [-3.0, -3.0, -3.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 0, 0]])
    assert sequence_logp(logp, mask, "mean").tolist() == [-2.5, -0.375, 0.0]  # -5 / 2, -0.75 / 2, no token: 0


def test_ipo_on_mean_log_ratios_by_hand() -> None:
    """algorithm.ipo_logratio=mean (TRL's IPO): each response's log-ratio is the mean over its tokens. Pair 0:
    chosen tokens (policy - ref) 0.5, -0.1 (mean 0.2), rejected -0.3, -0.2, -0.4 (mean -0.3): margin 0.5,
    loss (0.5 - 5)^2 = 20.25, where the sums (margin 0.4 - -0.9 = 1.3) give (1.3 - 5)^2 = 13.69."""
    policy_c, ref_c = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.5, -1.9, -7.0]])
    policy_r, ref_r = torch.tensor([[-2.0, -1.0, -3.0]]), torch.tensor([[-1.7, -0.8, -2.6]])
    mask_c, mask_r = torch.tensor([[1, 1, 0]]), torch.tensor([[1, 1, 1]])

    def ipo(reduce: str) -> float:
        losses, _ = preference_loss(
            chosen_logp=sequence_logp(policy_c, mask_c, reduce), rejected_logp=sequence_logp(policy_r, mask_r, reduce),
            ref_chosen_logp=sequence_logp(ref_c, mask_c, reduce), ref_rejected_logp=sequence_logp(ref_r, mask_r, reduce),
            beta=BETA, kind="ipo")  # type: ignore[arg-type]
        return float(losses[0])

    assert ipo("mean") == pytest.approx(20.25)
    assert ipo("sum") == pytest.approx(13.69)
    with pytest.raises(ValueError, match="unknown reduce 'max'; allowed: sum, mean"):
        sequence_logp(policy_c, mask_c, "max")  # type: ignore[arg-type]
