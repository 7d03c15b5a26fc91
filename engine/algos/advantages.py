"""Advantage estimators: one registry, one declared input record (AdvInputs).

Shapes: B batch (responses), T response tokens, G number of distinct groups (prompts).

Every estimator takes one AdvInputs and returns `(adv [B, T], returns [B, T])`, both zero
at positions where `response_mask` is 0. What an estimator needs beyond rewards is declared
when it is registered (`needs_values`, `needs_baseline`, `group_based`) so the config layer and
the driver check requirements from the registry, with no per-estimator branches.

Definitions follow verl `verl/trainer/ppo/core_algos.py` (the function named in each
docstring); outcome rewards are `sum_t token_rewards * response_mask`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.algos.masked import masked_sum, masked_whiten


@dataclass(frozen=True)
class AdvInputs:
    """What every estimator is given; each reads the fields it needs.

    token_rewards, response_mask: [B, T]; group_ids: [B] (responses to one prompt share an id); values: [B, T]
    (a critic's, for GAE); baseline: [B] (a reward per response, for ReMax); gamma, lam: discount and GAE's
    lambda; norm_by_std: divide group-centred scores by the group's std; eps: added to that std.
    """

    token_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor
    values: torch.Tensor | None = None
    baseline: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    eps: float = 1e-6


AdvEstimatorFn = Callable[[AdvInputs], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AdvEstimator:
    """A registered estimator and what it needs; called with AdvInputs' fields as keywords.

    needs_values: a critic's values [B, T] (GAE). needs_baseline: a per-response baseline
    reward [B] (ReMax's greedy response). group_based: statistics over responses sharing a
    `group_ids` value, so rollouts need n >= 2 responses per prompt to be meaningful. reads: which of
    the settings `gamma`, `lam`, `norm_by_std` it uses (the config refuses the others when set).
    """

    name: str
    fn: AdvEstimatorFn
    needs_values: bool = False
    needs_baseline: bool = False
    group_based: bool = False
    reads: frozenset[str] = frozenset()

    @torch.no_grad()
    def __call__(self, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Check the declared inputs are present, then run the estimator: (adv [B, T], returns [B, T])."""
        x = AdvInputs(**inputs)
        if self.needs_values and x.values is None:
            raise ValueError(f"advantage estimator {self.name!r} needs values (a critic)")
        if self.needs_baseline and x.baseline is None:
            raise ValueError(f"advantage estimator {self.name!r} needs a baseline reward per response")
        return self.fn(x)


ADV_ESTIMATORS: dict[str, AdvEstimator] = {}


def register_adv_estimator(
    name: str, *, needs_values: bool = False, needs_baseline: bool = False, group_based: bool = False,
    reads: tuple[str, ...] = (),
) -> Callable[[AdvEstimatorFn], AdvEstimator]:
    """Decorator: add `fn` to ADV_ESTIMATORS under `name` with its requirements; returns the registered
    estimator, so the module's name calls it with keywords as the registry does."""

    def register(fn: AdvEstimatorFn) -> AdvEstimator:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        if set(reads) - {"gamma", "lam", "norm_by_std"}:
            raise ValueError(f"advantage estimator {name!r}: reads={reads!r}; allowed: gamma, lam, norm_by_std")
        estimator = AdvEstimator(name=name, fn=fn, needs_values=needs_values, needs_baseline=needs_baseline,
                                 group_based=group_based, reads=frozenset(reads))
        ADV_ESTIMATORS[name] = estimator
        return estimator

    return register


def get_adv_estimator(name: str) -> AdvEstimator:
    """The registered estimator `name`; ValueError listing the allowed names otherwise."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; allowed: {sorted(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name]


# ---------------------------------------------------------------------------------------------
# Group statistics (vectorised; group ids are arbitrary, possibly non-contiguous integers)
# ---------------------------------------------------------------------------------------------


def _group_sums(x: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample sum and count of its group. x: [B], group_ids: [B] -> (sum [B], count [B])."""
    # Relabel arbitrary ids to 0..G-1: inverse [B] indexes the G unique ids.
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    zeros = x.new_zeros(unique_ids.shape[0])  # [G]
    sums = zeros.index_add(0, inverse, x)  # [G]
    counts = zeros.index_add(0, inverse, torch.ones_like(x))  # [G]
    return sums[inverse], counts[inverse]  # gather back: [G] -> [B]


def group_mean_std(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and unbiased std of its group's scores (verl `compute_grpo_outcome_advantage`).

    scores: [B], group_ids: LongTensor [B] -> (mean [B], std [B]).
    A one-sample group gets mean 0 and std 1, as in verl.
    """
    sums, counts = _group_sums(scores, group_ids)
    mean = sums / counts
    sq_dev, _ = _group_sums((scores - mean) ** 2, group_ids)  # two-pass variance, like torch.std
    std = torch.sqrt(sq_dev / (counts - 1).clamp_min(1.0))
    single = counts == 1
    return torch.where(single, torch.zeros_like(mean), mean), torch.where(single, torch.ones_like(std), std)


def outcome_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One scalar reward per response: token_rewards [B, T], response_mask [B, T] -> [B]."""
    return masked_sum(token_rewards, response_mask, dim=-1)


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Spread a per-sequence value over its tokens: [B] -> [B, 1] * mask [B, T] -> [B, T]."""
    return per_seq.unsqueeze(-1) * response_mask.to(per_seq.dtype)


# ---------------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------------


@register_adv_estimator("gae", needs_values=True, reads=("gamma", "lam"))
def gae(x: AdvInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, eq. 16; verl `compute_gae_advantage_return`).

    token_rewards, response_mask, values: [B, T] -> (adv [B, T] whitened over the mask,
    returns [B, T] = raw adv + values). Tokens with mask 0 (padding, or tool-output tokens in
    the middle of a multi-turn response) are skipped: value and running GAE carry through them.
    """
    values, gamma, lam = x.values, x.gamma, x.lam
    if values is None:
        raise ValueError("gae needs values")
    mask = x.response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])  # [B]
    running = torch.zeros_like(values[:, 0])  # [B]
    adv_reversed = []
    for t in reversed(range(x.token_rewards.shape[1])):
        delta = x.token_rewards[:, t] + gamma * next_value - values[:, t]
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        running = torch.where(mask[:, t], delta + gamma * lam * running, running)
        adv_reversed.append(running)
    adv = torch.stack(adv_reversed[::-1], dim=1)  # T x [B] -> [B, T]
    returns = torch.where(mask, adv + values, torch.zeros_like(adv))
    return masked_whiten(adv, x.response_mask) * x.response_mask, returns


@register_adv_estimator("grpo", group_based=True, reads=("norm_by_std",))
def grpo(x: AdvInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath sec. 4.1.2; verl
    `compute_grpo_outcome_advantage`): (r - mean_g) / (std_g + eps), std unbiased.

    token_rewards, response_mask: [B, T], group_ids: [B] -> (adv, returns) [B, T], equal.
    `norm_by_std=False` drops the division: Dr. GRPO's advantage (Liu et al. 2025, sec. 3.1), which is Dr.
    GRPO only with its loss aggregation too (seq-mean-token-sum-norm, agg.py).
    """
    scores = outcome_scores(x.token_rewards, x.response_mask)  # [B]
    mean, std = group_mean_std(scores, x.group_ids)  # [B], [B]
    centered = scores - mean
    adv = _broadcast(centered / (std + x.eps) if x.norm_by_std else centered, x.response_mask)
    return adv, adv


@register_adv_estimator("dr_grpo", group_based=True)
def dr_grpo(x: AdvInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO's advantage (Liu et al. 2025, arXiv 2503.20783, sec. 3.1): r - mean_g. The method also
    aggregates the loss with seq-mean-token-sum-norm (sec. 3.2, agg.py), a setting of the actor.

    GRPO with `norm_by_std` forced False, whatever is passed. Shapes as in `grpo`.
    """
    return grpo.fn(replace(x, norm_by_std=False))


@register_adv_estimator("rloo", group_based=True)
def rloo(x: AdvInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740; verl `compute_rloo_outcome_advantage`):
    r_i - (sum_g - r_i) / (n_g - 1).

    token_rewards, response_mask: [B, T], group_ids: [B] -> (adv, returns) [B, T], equal.
    A one-sample group has no other sample: baseline 0, so adv = r (as verl's `rloo`).
    """
    scores = outcome_scores(x.token_rewards, x.response_mask)  # [B]
    sums, counts = _group_sums(scores, x.group_ids)  # [B], [B]
    leave_one_out = (sums - scores) / (counts - 1).clamp_min(1.0)
    adv = _broadcast(torch.where(counts > 1, scores - leave_one_out, scores), x.response_mask)
    return adv, adv


def _discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'}, t' the next trained token: a token the mask leaves out (a tool's
    observation between two turns, padding) is not a step of the policy, so the running return
    passes over it unchanged, as in `gae`, and its own return is 0. (verl's
    `compute_reinforce_plus_plus_outcome_advantage` resets the sum at every masked token: in a
    multi-turn rollout every turn but the last would get return 0.) [B, T] -> [B, T]."""
    mask = response_mask.bool()
    running = torch.zeros_like(token_rewards[:, 0])  # [B]
    returns_reversed = []
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
        returns_reversed.append(torch.where(mask[:, t], running, torch.zeros_like(running)))
    return torch.stack(returns_reversed[::-1], dim=1)  # T x [B] -> [B, T]


@register_adv_estimator("reinforce_plus_plus", reads=("gamma",))
def reinforce_plus_plus(x: AdvInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262, sec. 3; verl `compute_reinforce_plus_plus_outcome_advantage`):
    discounted return per token, whitened over the whole batch.

    token_rewards, response_mask: [B, T] -> (adv [B, T] whitened, returns [B, T] unwhitened).
    """
    returns = _discounted_returns(x.token_rewards, x.response_mask, x.gamma) * x.response_mask
    return masked_whiten(returns, x.response_mask) * x.response_mask, returns


@register_adv_estimator("reinforce_plus_plus_baseline", group_based=True)
def reinforce_plus_plus_baseline(x: AdvInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv 2501.03262; verl
    `compute_reinforce_plus_plus_baseline_outcome_advantage`): r - mean_g, then whitened over
    every token of the batch (a one-sample group has mean 0).

    token_rewards, response_mask: [B, T], group_ids: [B] -> (adv, returns) [B, T], equal.
    """
    scores = outcome_scores(x.token_rewards, x.response_mask)  # [B]
    mean, _ = group_mean_std(scores, x.group_ids)
    adv = _broadcast(scores - mean, x.response_mask)
    adv = masked_whiten(adv, x.response_mask) * x.response_mask
    return adv, adv


@register_adv_estimator("remax", needs_baseline=True)
def remax(x: AdvInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2024, arXiv 2310.10505; verl `compute_remax_outcome_advantage`):
    undiscounted reward-to-go minus the greedy response's reward.

    token_rewards, response_mask: [B, T], baseline: [B] -> (adv [B, T], returns [B, T]).
    """
    if x.baseline is None:
        raise ValueError("remax needs a baseline (the greedy response's reward)")
    # Reverse cumulative sum along T: flip, cumsum, flip back. [B, T] -> [B, T]
    mask = x.response_mask.to(x.token_rewards.dtype)
    returns = (x.token_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask  # 0 on a hole (an observation)
    return returns - _broadcast(x.baseline.to(returns.dtype), x.response_mask), returns
