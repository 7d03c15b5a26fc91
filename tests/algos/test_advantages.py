"""Advantage estimators: hand cases, properties, and loop references (the definitions written
the slow, obvious way, one group / one sequence at a time) against the vectorised code."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.algos import (
    ADV_ESTIMATORS,
    dr_grpo,
    gae,
    get_adv_estimator,
    group_mean_std,
    grpo,
    register_adv_estimator,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from engine.algos.masked import masked_whiten

R2 = 1.0 / math.sqrt(2.0)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def outcome(scores: list[float], lengths: list[int], t: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """token_rewards [B, T] with the score on each response's last token, and the mask."""
    rewards = torch.zeros(len(scores), t)
    mask = torch.zeros(len(scores), t)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


# ---------------------------------------------------------------------------------------------
# Loop references (verl's dict-of-lists style)
# ---------------------------------------------------------------------------------------------


def loop_group_stats(scores: torch.Tensor, ids: list[int]) -> tuple[dict, dict, dict]:
    members: dict[int, list[torch.Tensor]] = {}
    for i, gid in enumerate(ids):
        members.setdefault(gid, []).append(scores[i])
    mean, std, count = {}, {}, {}
    for gid, xs in members.items():
        stacked = torch.stack(xs)
        count[gid] = len(xs)
        mean[gid] = stacked.mean() if len(xs) > 1 else torch.tensor(0.0, dtype=scores.dtype)
        std[gid] = stacked.std() if len(xs) > 1 else torch.tensor(1.0, dtype=scores.dtype)
    return mean, std, count


def loop_grpo(rewards, mask, ids, norm_by_std, eps=1e-6):
    scores = (rewards * mask).sum(-1)
    mean, std, _ = loop_group_stats(scores, ids)
    out = torch.stack(
        [
            (scores[i] - mean[g]) / (std[g] + eps) if norm_by_std else scores[i] - mean[g]
            for i, g in enumerate(ids)
        ]
    )
    return out[:, None] * mask


def loop_rloo(rewards, mask, ids):
    scores = (rewards * mask).sum(-1)
    out = []
    for i, g in enumerate(ids):
        others = [scores[j] for j, h in enumerate(ids) if h == g and j != i]
        out.append(scores[i] - torch.stack(others).mean() if others else scores[i])
    return torch.stack(out)[:, None] * mask


def loop_rfpp_baseline(rewards, mask, ids):
    scores = (rewards * mask).sum(-1)
    mean, _, _ = loop_group_stats(scores, ids)
    centered = torch.stack([scores[i] - mean[g] for i, g in enumerate(ids)])[:, None] * mask
    return masked_whiten(centered, mask) * mask


def loop_gae_raw(rewards, values, mask, gamma, lam):
    """Textbook GAE on each response's sub-sequence of unmasked tokens (masked tokens removed),
    scattered back; masked positions hold 0. Returns (raw adv, returns)."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running, next_value = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            running = delta + gamma * lam * running
            adv[b, t] = running
            next_value = values[b, t]
    return adv, (adv + values) * mask


# ---------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------


def test_grpo_hand_noncontiguous_ids_and_singleton():
    # group 7: scores 0, 3, 6 (mean 3, unbiased std 3); group -4: a single response scoring 5
    rewards, mask = outcome([0.0, 5.0, 3.0, 6.0], [2, 3, 1, 3])
    ids = torch.tensor([7, -4, 7, 7])
    adv, returns = grpo(token_rewards=rewards, response_mask=mask, group_ids=ids)
    expected = torch.tensor([-1.0, 5.0, 0.0, 1.0])[:, None] * mask  # singleton: (5 - 0) / (1 + eps)
    close(adv, expected)
    close(returns, expected)


def test_dr_grpo_hand_ignores_norm_by_std():
    rewards, mask = outcome([0.0, 5.0, 3.0, 6.0], [2, 3, 1, 3])
    ids = torch.tensor([7, -4, 7, 7])
    adv, _ = dr_grpo(token_rewards=rewards, response_mask=mask, group_ids=ids, norm_by_std=True)
    close(adv, torch.tensor([-3.0, 5.0, 0.0, 3.0])[:, None] * mask)
    adv2, _ = grpo(token_rewards=rewards, response_mask=mask, group_ids=ids, norm_by_std=False)
    close(adv2, adv)


def test_rloo_hand():
    # group 7: 0, 3, 6 -> 0 - 4.5, 3 - 3, 6 - 1.5; singleton group keeps its score (baseline 0)
    rewards, mask = outcome([0.0, 5.0, 3.0, 6.0], [2, 3, 1, 3])
    adv, returns = rloo(token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([7, -4, 7, 7]))
    expected = torch.tensor([-4.5, 5.0, 0.0, 4.5])[:, None] * mask
    close(adv, expected)
    close(returns, expected)


def test_reinforce_plus_plus_baseline_hand():
    # groups {1, 3} and {10, 10}: centered -1, +1, 0, 0 on one token each -> whiten over 4 tokens:
    # mean 0, unbiased var 2/3 -> -1 / sqrt(2/3), +1 / sqrt(2/3), 0, 0
    rewards, mask = outcome([1.0, 3.0, 10.0, 10.0], [1, 1, 1, 1], t=2)
    adv, returns = reinforce_plus_plus_baseline(
        token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0, 5, 5])
    )
    s = math.sqrt(1.5)
    close(adv, [[-s, 0.0], [s, 0.0], [0.0, 0.0], [0.0, 0.0]])
    close(returns, adv)


def test_reinforce_plus_plus_hand_discount_and_whiten():
    # seq 0: one token, reward 1 -> return 1; seq 1: rewards (2, 3), gamma 1 -> returns (5, 3)
    rewards = torch.tensor([[1.0, 0.0], [2.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    adv, returns = reinforce_plus_plus(token_rewards=rewards, response_mask=mask, group_ids=torch.arange(2))
    close(returns, [[1.0, 0.0], [5.0, 3.0]])
    close(adv, [[-1.0, 0.0], [1.0, 0.0]])  # {1, 5, 3}: mean 3, std 2


def test_reinforce_plus_plus_hand_gamma_and_reset():
    # gamma 0.5: rewards (0, 0, 4) -> returns (1, 2, 4)
    rewards = torch.tensor([[0.0, 0.0, 4.0]])
    _, returns = reinforce_plus_plus(
        token_rewards=rewards, response_mask=torch.ones(1, 3), group_ids=torch.zeros(1), gamma=0.5
    )
    close(returns, [[1.0, 2.0, 4.0]])
    # a masked token in the middle (a tool's observation) is passed over: t=2 -> 2, t=1 is not a
    # step (its return 0, its reward never added), t=0 -> 1 + 0.5 * 2 = 2 (reset there, verl's way,
    # gave 1: every turn before the last observation got return 0)
    _, returns = reinforce_plus_plus(
        token_rewards=torch.tensor([[1.0, 10.0, 2.0]]),
        response_mask=torch.tensor([[1.0, 0.0, 1.0]]),
        group_ids=torch.zeros(1),
        gamma=0.5,
    )
    close(returns, [[2.0, 0.0, 2.0]])
    # two turns, the outcome reward on the last token: every trained token of both turns returns it
    _, returns = reinforce_plus_plus(
        token_rewards=torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]),
        response_mask=torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]]),
        group_ids=torch.zeros(1),
    )
    close(returns, [[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])


def test_remax_hand():
    rewards = torch.tensor([[0.0, 0.0, 3.0], [0.0, 5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, returns = remax(
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.arange(2),
        baseline=torch.tensor([1.0, 2.0]),
    )
    close(returns, [[3.0, 3.0, 3.0], [5.0, 5.0, 0.0]])
    close(adv, [[2.0, 2.0, 2.0], [3.0, 3.0, 0.0]])
    # a hole (an observation, response_mask 0 between trained tokens): 0 there, the reward still reaches
    # the tokens before it
    adv, returns = remax(token_rewards=torch.tensor([[0.0, 0.0, 0.0, 3.0]]),
                         response_mask=torch.tensor([[1.0, 0.0, 0.0, 1.0]]), group_ids=torch.zeros(1),
                         baseline=torch.tensor([1.0]))
    close(returns, [[3.0, 0.0, 0.0, 3.0]])
    close(adv, [[2.0, 0.0, 0.0, 2.0]])


def test_gae_hand():
    # gamma = lam = 0.5, rewards (0, 1), values (0.5, 0.5):
    # t=1: delta = 1 - 0.5 = 0.5, A = 0.5;  t=0: delta = 0 + 0.25 - 0.5 = -0.25, A = -0.25 + 0.25 * 0.5
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5]])
    adv, returns = gae(
        token_rewards=rewards,
        response_mask=torch.ones(1, 2),
        group_ids=torch.zeros(1),
        values=values,
        gamma=0.5,
        lam=0.5,
    )
    close(returns, [[-0.125 + 0.5, 0.5 + 0.5]])
    close(adv, [[-R2, R2]])  # two distinct values whiten to -+1/sqrt(2)


def test_gae_hand_skips_masked_middle_token():
    # mask (1, 0, 1), gamma = lam = 1, values (2, 7, 1), rewards (0, 9, 3):
    # t=2: delta = 3 - 1 = 2, A = 2;  t=1 skipped (reward 9 and value 7 ignored);
    # t=0: delta = 0 + 1 - 2 = -1, A = -1 + 2 = 1.  returns = A + V = (3, -, 3)
    adv, returns = gae(
        token_rewards=torch.tensor([[0.0, 9.0, 3.0]]),
        response_mask=torch.tensor([[1.0, 0.0, 1.0]]),
        group_ids=torch.zeros(1),
        values=torch.tensor([[2.0, 7.0, 1.0]]),
    )
    close(returns, [[3.0, 0.0, 3.0]])
    close(adv, [[-R2, 0.0, R2]])


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------


def test_group_mean_std_singleton_gets_mean0_std1():
    mean, std = group_mean_std(torch.tensor([4.0, 1.0, 3.0]), torch.tensor([100, 2, 2]))
    close(mean, [0.0, 2.0, 2.0])
    close(std, [1.0, math.sqrt(2.0), math.sqrt(2.0)])


def test_grpo_group_advantages_sum_to_zero():
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([3, 9, 3, 9, 3, 9, 9, 3])
    rewards = torch.randn(8, 5, generator=g)
    mask = torch.ones(8, 5)
    adv, _ = grpo(token_rewards=rewards, response_mask=mask, group_ids=ids)
    per_seq = adv[:, 0]
    for gid in (3, 9):
        assert abs(per_seq[ids == gid].sum()) < 1e-5


def test_gae_gamma_lam_1_values_0_returns_are_reverse_cumsum():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 6, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 3, 1, 5])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).double()
    rewards = rewards * mask
    _, returns = gae(
        token_rewards=rewards, response_mask=mask, group_ids=torch.arange(4), values=torch.zeros_like(rewards)
    )
    torch.testing.assert_close(returns, rewards.flip(-1).cumsum(-1).flip(-1) * mask)


def random_batch(seed: int, b: int, t: int, id_pool: list[int]):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64)
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.25).double()
    mask[:, 0] = 1  # every response has at least one token
    ids = [id_pool[i] for i in torch.randint(0, len(id_pool), (b,), generator=g).tolist()]
    return rewards, values, mask, ids


POOL = [-7, 0, 3, 1000, 2**40]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 9), t=st.integers(1, 6))
def test_group_estimators_match_loop_reference(seed, b, t):
    rewards, _, mask, ids = random_batch(seed, b, t, POOL)
    gid = torch.tensor(ids)
    kw = dict(token_rewards=rewards, response_mask=mask, group_ids=gid)
    torch.testing.assert_close(grpo(**kw)[0], loop_grpo(rewards, mask, ids, True))
    torch.testing.assert_close(grpo(**kw, norm_by_std=False)[0], loop_grpo(rewards, mask, ids, False))
    torch.testing.assert_close(dr_grpo(**kw)[0], loop_grpo(rewards, mask, ids, False))
    torch.testing.assert_close(rloo(**kw)[0], loop_rloo(rewards, mask, ids))
    torch.testing.assert_close(reinforce_plus_plus_baseline(**kw)[0], loop_rfpp_baseline(rewards, mask, ids))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 5),
    t=st.integers(2, 7),
    gamma=st.sampled_from([1.0, 0.9, 0.5]),
    lam=st.sampled_from([1.0, 0.95, 0.0]),
)
def test_gae_matches_subsequence_reference(seed, b, t, gamma, lam):
    rewards, values, mask, _ = random_batch(seed, b, t, [0])
    adv, returns = gae(
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.zeros(b),
        values=values,
        gamma=gamma,
        lam=lam,
    )
    raw, expected_returns = loop_gae_raw(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(returns, expected_returns)
    if mask.sum() > 1:
        torch.testing.assert_close(adv, masked_whiten(raw, mask) * mask)


def test_rloo_equals_explicit_formula():
    # RLOO: A_i = n / (n - 1) * (r_i - mean_g), the leave-one-out baseline rewritten
    g = torch.Generator().manual_seed(2)
    ids = torch.tensor([5, 5, 5, 5, 8, 8, 8])
    rewards, mask = outcome(torch.randn(7, generator=g).tolist(), [3] * 7)
    adv, _ = rloo(token_rewards=rewards, response_mask=mask, group_ids=ids)
    scores = rewards.sum(-1)
    expected = torch.empty(7)
    for gid in (5, 8):
        sel = ids == gid
        n = sel.sum()
        expected[sel] = n / (n - 1) * (scores[sel] - scores[sel].mean())
    close(adv[:, 0], expected)


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_holes_get_zero_adv_and_returns(name):
    """Observation tokens inside a response (multi-turn: response_mask 0 between trained tokens) are
    neither trained nor credited: adv and returns 0 there, as the module docstring says."""
    rewards, values, _, ids = random_batch(3, 6, 5, [1, 2])
    mask = torch.tensor([[1, 0, 0, 1, 1], [1, 1, 0, 1, 0], [0, 1, 0, 1, 1], [1, 0, 1, 0, 1], [1, 1, 1, 1, 1],
                         [1, 0, 0, 0, 1]], dtype=torch.float64)
    adv, returns = get_adv_estimator(name)(token_rewards=rewards * mask, values=values, response_mask=mask,
                                           group_ids=torch.tensor(ids), baseline=torch.arange(6.0, dtype=torch.float64))
    assert (adv[mask == 0] == 0).all() and (returns[mask == 0] == 0).all(), (adv * (1 - mask), returns * (1 - mask))


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_padding_gets_zero_adv_and_does_not_affect_results(name):
    rewards, values, mask, ids = random_batch(3, 6, 5, [1, 2])
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in (5, 3, 1, 4, 2, 5)], dtype=torch.float64)
    est = get_adv_estimator(name)
    kw = dict(
        response_mask=mask, group_ids=torch.tensor(ids), baseline=torch.arange(6.0, dtype=torch.float64)
    )
    adv, returns = est(token_rewards=rewards * mask, values=values, **kw)
    garbage = torch.full_like(rewards, 1e6) * (1 - mask)
    adv2, returns2 = est(token_rewards=rewards * mask + garbage, values=values + garbage, **kw)
    assert (adv[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(returns2, returns)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_registry_specs():
    assert set(ADV_ESTIMATORS) == {
        "gae",
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
    }
    assert [n for n, s in sorted(ADV_ESTIMATORS.items()) if s.needs_values] == ["gae"]
    assert [n for n, s in sorted(ADV_ESTIMATORS.items()) if s.needs_baseline] == ["remax"]
    assert {n for n, s in ADV_ESTIMATORS.items() if s.group_based} == {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus_baseline",
    }
    assert all(s.name == n for n, s in ADV_ESTIMATORS.items())
    assert get_adv_estimator("grpo") is grpo


def test_registry_checks_declared_inputs():
    rewards, mask = outcome([1.0], [1])
    with pytest.raises(ValueError, match="needs values"):
        get_adv_estimator("gae")(token_rewards=rewards, response_mask=mask, group_ids=torch.zeros(1))
    with pytest.raises(ValueError, match="needs a baseline"):
        get_adv_estimator("remax")(token_rewards=rewards, response_mask=mask, group_ids=torch.zeros(1))


def test_unknown_estimator_names_allowed_values():
    with pytest.raises(ValueError) as info:
        get_adv_estimator("ppo")
    for name in ADV_ESTIMATORS:
        assert repr(name) in str(info.value)


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("grpo")(grpo)
