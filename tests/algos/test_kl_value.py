"""KL estimators, KL loss, in-reward KL penalty, KL controllers, clipped value loss."""

import math

import pytest
import torch

from engine.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    clipped_value_loss,
    kl_loss,
    kl_penalty,
)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# d = logp - ref_logp = (0, 1, -2)
LOGP = torch.tensor([[0.0, 1.0, -2.0]], dtype=torch.float64)
REF = torch.zeros_like(LOGP)
E = math.exp


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("k1", "kl"), [0.0, 1.0, -2.0]),
        (("abs",), [0.0, 1.0, 2.0]),
        (("k2", "mse"), [0.0, 0.5, 2.0]),  # d^2 / 2
        (("k3", "low_var_kl"), [0.0, E(-1.0) + 1 - 1, E(2.0) - 2 - 1]),  # exp(-d) + d - 1
    ],
)
def test_kl_estimators_hand(names, expected):
    for name in names:
        close(kl_penalty(logp=LOGP, ref_logp=REF, estimator=name), [expected])


def test_kl_estimator_names():
    assert set(KL_ESTIMATORS) == {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"}


def test_k3_clamps_like_verl():
    logp = torch.tensor([[-30.0, 30.0]])
    # d = -30: -d clamped to 20, exp(20) - 20 - 1 clamped to 10; d = 30: exp(-20) + 20 - 1 = 19 -> 10
    close(kl_penalty(logp=logp, ref_logp=torch.zeros_like(logp), estimator="k3"), [[10.0, 10.0]])


def test_kl_unknown_estimator_names_allowed():
    with pytest.raises(ValueError) as info:
        kl_penalty(logp=LOGP, ref_logp=REF, estimator="full")
    for name in KL_ESTIMATORS:
        assert repr(name) in str(info.value)


def test_kl_loss_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = kl_loss(
        logp=LOGP, ref_logp=REF, response_mask=mask, estimator="k2", loss_agg_mode="token-mean"
    )
    close(loss, (0.0 + 0.5) / 2)
    close(stats["kl_loss"], 0.25)


def test_apply_kl_penalty_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    logp = torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, 9.0]])  # d; the 9 is padding
    rewards, stats = apply_kl_penalty(
        token_scores=scores,
        logp=logp,
        ref_logp=torch.zeros_like(logp),
        response_mask=mask,
        kl_coef=0.5,
        estimator="k1",
    )
    close(rewards, [[-0.5, -0.5, 0.5], [-1.0, 2.0, 0.0]])
    close(stats["reward_kl_penalty"], 1.0)  # per-sequence means 1 and (2 + 0) / 2 = 1
    close(stats["reward_kl_penalty_coeff"], 0.5)


def test_fixed_controller():
    ctrl = FixedKLController(kl_coef=0.05)
    ctrl.update(current_kl=100.0, n_steps=64)
    assert ctrl.value == 0.05
    other = FixedKLController(kl_coef=0.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_formula():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    ctrl.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2: x (1 + 0.2 * 256 / 10000)
    assert ctrl.value == pytest.approx(0.1 * 1.00512, abs=1e-15)
    ctrl.update(current_kl=6.6, n_steps=500)  # error 0.1: x 1.005
    assert ctrl.value == pytest.approx(0.1 * 1.00512 * 1.005, abs=1e-15)
    ctrl.update(current_kl=0.0, n_steps=1000)  # error -1 clipped to -0.2: x 0.98
    assert ctrl.value == pytest.approx(0.1 * 1.00512 * 1.005 * 0.98, abs=1e-15)


def test_adaptive_controller_state_round_trip_continues_exactly():
    kls = [9.0, 6.6, 0.3, 7.1, 5.9]
    run = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=1000)
    for kl in kls[:2]:
        run.update(current_kl=kl, n_steps=64)
    resumed = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=1000)
    resumed.load_state_dict(run.state_dict())
    for kl in kls[2:]:
        run.update(current_kl=kl, n_steps=64)
        resumed.update(current_kl=kl, n_steps=64)
    assert resumed.value == run.value  # bit for bit


def test_adaptive_controller_rejects_bad_settings():
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=0.0, horizon=10)


def test_clipped_value_loss_hand():
    # old values 0, clip 0.5 -> predictions clipped to [-0.5, 0.5]
    #   vpred 0.5, R 1: (0.5-1)^2 = 0.25 both          -> 0.25
    #   vpred 2,   R 1: 1 vs (0.5-1)^2 = 0.25          -> 1
    #   vpred -1,  R 1: 4 vs (-0.5-1)^2 = 2.25         -> 4
    #   vpred 2,   R 2: 0 vs (0.5-2)^2 = 2.25          -> 2.25 (clipped term larger: counted)
    #   5th token is padding
    vpreds = torch.tensor([[0.5, 2.0, -1.0, 2.0, 100.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 1.0, 2.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, stats = clipped_value_loss(
        vpreds=vpreds, values=torch.zeros(1, 5), returns=returns, response_mask=mask, clip_range_value=0.5
    )
    close(loss, 0.5 * (0.25 + 1 + 4 + 2.25) / 4)
    close(stats["vf_clipfrac"], 1 / 4)
    # gradient flows only through the unclipped terms: 0.5 * 2 (v - R) / 4
    (grad,) = torch.autograd.grad(loss, vpreds)
    close(grad, [[0.25 * -0.5, 0.25 * 1.0, 0.25 * -2.0, 0.0, 0.0]])


def test_clipped_value_loss_agg_mode():
    loss, _ = clipped_value_loss(
        vpreds=torch.tensor([[1.0, 1.0], [3.0, 0.0]]),
        values=torch.tensor([[1.0, 1.0], [3.0, 0.0]]),
        returns=torch.zeros(2, 2),
        response_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        clip_range_value=0.2,
        loss_agg_mode="seq-mean-token-mean",
    )
    close(loss, 0.5 * (1.0 + 9.0) / 2)  # sequence means 1 and 9
