"""Policy losses and loss aggregation: hand cases, clip gradients, dual clip, registry."""

import math

import pytest
import torch

from engine.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    agg_units,
    get_policy_loss,
    gspo,
    ppo_clip,
    register_policy_loss,
)

LN = math.log


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def tokens(ratios: list[float], advs: list[float]) -> dict[str, torch.Tensor]:
    """One response of len(ratios) tokens with the given ratio pi/pi_old and advantage per token."""
    logp = torch.tensor([[LN(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    return dict(
        logp=logp,
        old_logp=torch.zeros_like(logp.detach()),
        adv=torch.tensor([advs], dtype=torch.float64),
        response_mask=torch.ones_like(logp.detach()),
    )


# ---------------------------------------------------------------------------------------------
# ppo_clip
# ---------------------------------------------------------------------------------------------

# (ratio, adv) -> per-token loss with clip 0.2 and clip_ratio_c 3:
#   (1.5, +1): max(-1.5, -1.2) = -1.2   upper clip binds
#   (0.5, +1): max(-0.5, -0.8) = -0.5   no clip
#   (0.5, -1): max( 0.5,  0.8) =  0.8   lower clip binds
#   (5.0, -1): max( 5.0,  1.2) =  5.0 -> dual clip min(5, 3) = 3
PPO_CASE = tokens([1.5, 0.5, 0.5, 5.0], [1.0, 1.0, -1.0, -1.0])


def test_ppo_clip_hand():
    loss, stats = ppo_clip(**PPO_CASE, clip_low=0.2, clip_high=0.2)
    close(loss, (-1.2 - 0.5 + 0.8 + 3.0) / 4)
    close(stats["pg_clipfrac"], 2 / 4)
    close(stats["pg_clipfrac_lower"], 1 / 4)
    close(stats["ppo_kl"], -(LN(1.5) + LN(0.5) + LN(0.5) + LN(5.0)) / 4)
    assert all(not s.requires_grad and s.dim() == 0 for s in stats.values())


def test_ppo_clip_asymmetric_hand():
    # clip-higher: [1 - 0.2, 1 + 0.28]; (1.5, +1) -> -1.28, (0.5, -1) -> 0.8
    loss, _ = ppo_clip(**tokens([1.5, 0.5], [1.0, -1.0]), clip_low=0.2, clip_high=0.28)
    close(loss, (-1.28 + 0.8) / 2)


def test_ppo_clip_zero_gradient_where_clip_binds():
    case = tokens([1.5, 0.5, 0.5, 5.0, 1.1, 0.9], [1.0, 1.0, -1.0, -1.0, 1.0, -1.0])
    loss, _ = ppo_clip(**case, clip_low=0.2, clip_high=0.2)
    (grad,) = torch.autograd.grad(loss, case["logp"])
    # d/dlogp of -A * r / N is -A * r / N where unclipped; 0 where a clip (or the dual clip) binds
    close(grad, [[0.0, -0.5 / 6, 0.0, 0.0, -1.1 / 6, 0.9 / 6]])


def test_ppo_dual_clip_bounds_negative_advantages():
    g = torch.Generator().manual_seed(0)
    log_ratio = 6 * torch.randn(1, 50, generator=g, dtype=torch.float64)
    adv = -torch.rand(1, 50, generator=g, dtype=torch.float64)
    for t in range(50):  # one token at a time: the loss is that token's loss
        mask = torch.zeros(1, 50, dtype=torch.float64)
        mask[0, t] = 1
        loss, _ = ppo_clip(
            logp=log_ratio,
            old_logp=torch.zeros_like(log_ratio),
            adv=adv,
            response_mask=mask,
            clip_low=0.2,
            clip_high=0.2,
            clip_ratio_c=3.0,
        )
        assert loss <= -adv[0, t] * 3.0 + 1e-12
    # a huge ratio with adv -2 sits exactly on the bound 2 * 3
    loss, _ = ppo_clip(**tokens([1e30], [-2.0]), clip_low=0.2, clip_high=0.2)
    close(loss, 6.0)


def test_ppo_clip_log_ratio_clamped_at_20():
    case = tokens([1.0], [1.0])
    case["old_logp"] = torch.full_like(case["old_logp"], -30.0)  # log ratio 30 -> clamped to 20
    loss, stats = ppo_clip(**case, clip_low=0.2, clip_high=1e10)
    close(loss, -math.exp(20.0), atol=1e-3)
    close(stats["ppo_kl"], -20.0)


def test_ppo_clip_rejects_clip_ratio_c_at_most_1():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip(**PPO_CASE, clip_low=0.2, clip_high=0.2, clip_ratio_c=1.0)


def test_ppo_clip_padding_ignored():
    case = tokens([1.5, 0.5, 7.0], [1.0, 1.0, -3.0])
    case["response_mask"] = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = ppo_clip(**case, clip_low=0.2, clip_high=0.2)
    close(loss, (-1.2 - 0.5) / 2)
    close(stats["pg_clipfrac"], 0.5)
    close(stats["pg_clipfrac_lower"], 0.0)


# ---------------------------------------------------------------------------------------------
# gspo
# ---------------------------------------------------------------------------------------------


def gspo_case() -> dict[str, torch.Tensor]:
    # seq 0: token log-ratios (ln 4, 0)   -> s = exp(ln 4 / 2) = 2,   adv +1 -> clipped: -1.2
    # seq 1: token log-ratios (0, ln 1/4) -> s = 1/2,                  adv +1 -> unclipped: -0.5
    # third position is padding with garbage
    logp = torch.tensor(
        [[LN(4.0), 0.0, 50.0], [0.0, LN(0.25), -50.0]], dtype=torch.float64, requires_grad=True
    )
    return dict(
        logp=logp,
        old_logp=torch.zeros(2, 3, dtype=torch.float64),
        adv=torch.tensor([[1.0, 1.0, 9.0], [1.0, 1.0, 9.0]], dtype=torch.float64),
        response_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64),
    )


def test_gspo_hand():
    case = gspo_case()
    loss, stats = gspo(**case, clip_low=0.2, clip_high=0.2, loss_agg_mode="seq-mean-token-mean")
    close(loss, (-1.2 - 0.5) / 2)
    close(stats["pg_clipfrac"], 2 / 4)
    close(stats["pg_clipfrac_lower"], 0.0)
    close(stats["ppo_kl"], 0.0)  # -(ln 4 + 0 + 0 + ln 1/4) / 4
    # straight-through: every token of an unclipped sequence gets d/dlogp = -A * s_i * weight,
    # weight 1/2 (token mean) * 1/2 (seq mean); the clipped sequence gets none
    (grad,) = torch.autograd.grad(loss, case["logp"])
    close(grad, [[0.0, 0.0, 0.0], [-0.125, -0.125, 0.0]])


def test_gspo_honours_loss_agg_mode():
    loss, _ = gspo(**gspo_case(), clip_low=0.2, clip_high=0.2, loss_agg_mode="seq-mean-token-sum")
    close(loss, (2 * -1.2 + 2 * -0.5) / 2)


def test_gspo_log_ratio_clamped_at_10():
    case = tokens([1.0], [1.0])
    case["old_logp"] = torch.full_like(case["old_logp"], -30.0)
    loss, _ = gspo(**case, clip_low=0.2, clip_high=1e10)
    close(loss, -math.exp(10.0), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------


def test_policy_loss_registry():
    assert POLICY_LOSSES == {"ppo_clip": ppo_clip, "gspo": gspo}
    assert get_policy_loss("gspo") is gspo
    with pytest.raises(ValueError) as info:
        get_policy_loss("vanilla_ppo")
    assert "'gspo'" in str(info.value) and "'ppo_clip'" in str(info.value)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("gspo")(gspo)


# ---------------------------------------------------------------------------------------------
# agg_loss
# ---------------------------------------------------------------------------------------------

# ragged mask: lengths 3, 1, and an empty row (its garbage must not count)
LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [9.0, 9.0, 9.0]])
LOSS_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # all tokens: 10 / 4
        ("seq-mean-token-sum", (6 + 4) / 2),  # sequence sums 6, 4; empty row excluded
        ("seq-mean-token-mean", (2 + 4) / 2),  # sequence means 2, 4
        ("seq-mean-token-sum-norm", (6 / 3 + 4 / 3) / 2),  # sequence sums / T, mean over non-empty rows
    ],
)
def test_agg_loss_hand(mode, expected):
    close(agg_loss(loss_mat=LOSS_MAT, loss_mask=LOSS_MASK, loss_agg_mode=mode), expected)


def test_dr_grpo_normalizer_is_the_configured_length_not_the_padding():
    # Dr. GRPO divides by the maximum response length L, whatever width the batch is padded to.
    wide = torch.cat([LOSS_MAT, torch.full((3, 5), 7.0)], dim=1)  # the same rows padded to T = 8
    wide_mask = torch.cat([LOSS_MASK, torch.zeros(3, 5)], dim=1)
    for mat, mask in ((LOSS_MAT, LOSS_MASK), (wide, wide_mask)):
        close(agg_loss(loss_mat=mat, loss_mask=mask, loss_agg_mode="seq-mean-token-sum-norm",
                       max_response_length=16), (6 / 16 + 4 / 16) / 2)
    # ...and by the number of responses, unlike verl's batch sum / loss_scale_factor (agg.py): the same
    # rows twice give the same loss here, where verl's would double.
    twice = agg_loss(loss_mat=torch.cat([LOSS_MAT, LOSS_MAT]), loss_mask=torch.cat([LOSS_MASK, LOSS_MASK]),
                     loss_agg_mode="seq-mean-token-sum-norm", max_response_length=16)
    close(twice, (6 / 16 + 4 / 16) / 2)


@pytest.mark.parametrize(("mode", "units"), [("token-mean", 4), ("seq-mean-token-sum", 2),
                                             ("seq-mean-token-mean", 2), ("seq-mean-token-sum-norm", 2)])
def test_agg_units_hand(mode, units):
    close(agg_units(loss_mask=LOSS_MASK, loss_agg_mode=mode), units)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_units_weighted_parts_give_the_whole_aggregate(mode):
    """The property the engine's micro-batch weights rely on: for any split of the rows, the
    units-weighted sum of the parts' aggregates is the aggregate of the whole batch."""
    gen = torch.Generator().manual_seed(0)
    mat = torch.randn(7, 5, generator=gen)
    mask = (torch.rand(7, 5, generator=gen) > 0.4).float()
    mask[3] = 0  # an empty row
    whole = agg_loss(loss_mat=mat, loss_mask=mask, loss_agg_mode=mode, max_response_length=9)
    total = agg_units(loss_mask=mask, loss_agg_mode=mode)
    for sizes in ([3, 3, 1], [1] * 7, [6, 1], [2, 5]):
        parts = zip(mat.split(sizes), mask.split(sizes))
        summed = sum(agg_loss(loss_mat=m, loss_mask=k, loss_agg_mode=mode, max_response_length=9)
                     * agg_units(loss_mask=k, loss_agg_mode=mode) / total for m, k in parts)
        close(summed, float(whole))


def test_agg_modes_differ_on_ragged_masks_and_relate_on_full_masks():
    ragged = {m: agg_loss(loss_mat=LOSS_MAT, loss_mask=LOSS_MASK, loss_agg_mode=m) for m in LOSS_AGG_MODES}
    assert len({round(float(v), 6) for v in ragged.values()}) == len(LOSS_AGG_MODES)
    # full mask (B=2, T=4): the two mean modes coincide, seq-mean-token-sum is T x token-mean, and
    # seq-mean-token-sum-norm with L = T equals token-mean
    full = torch.ones(2, 4)
    mat = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.0, 4.0, 4.0, 4.0]])
    values = {m: agg_loss(loss_mat=mat, loss_mask=full, loss_agg_mode=m) for m in LOSS_AGG_MODES}
    close(values["token-mean"], 3.0)
    close(values["seq-mean-token-mean"], 3.0)
    close(values["seq-mean-token-sum"], 12.0)
    close(values["seq-mean-token-sum-norm"], 3.0)  # (12 / 4 + 12 / 4) / 2


def test_agg_empty_mask_is_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        close(agg_loss(loss_mat=LOSS_MAT, loss_mask=torch.zeros(3, 3), loss_agg_mode=mode), 0.0)


def test_agg_unknown_mode_names_allowed():
    with pytest.raises(ValueError) as info:
        agg_loss(loss_mat=LOSS_MAT, loss_mask=LOSS_MASK, loss_agg_mode="token-sum")
    for mode in LOSS_AGG_MODES:
        assert repr(mode) in str(info.value)
