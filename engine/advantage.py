"""The advantage stage over a Batch: optional in-reward KL, then the configured estimator.

No branch per estimator: the registry entry says what it needs (values, a baseline) and the batch
supplies those columns when present.

Columns read: `token_scores` [B, T], `response_mask` [B, T], `group_id` [B]; `values` [B, T] (critic),
`baseline_score` [B] (ReMax), `old_logp` and `ref_logp` [B, T] (in-reward KL).
Columns written: `token_rewards`, `adv`, `returns` [B, T].
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine import algos
from engine.batch import Batch, response_lengths
from engine.config import AlgorithmConfig


def make_kl_controller(cfg: AlgorithmConfig) -> algos.FixedKLController | algos.AdaptiveKLController:
    if cfg.kl_ctrl == "adaptive":
        return algos.AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    return algos.FixedKLController(cfg.kl_coef)


def compute_advantages(
    batch: Batch, cfg: AlgorithmConfig, kl_coef: float, extra_scores: Mapping[str, float] | None = None,
    cost_coef: float | None = None,
) -> tuple[Batch, dict[str, float]]:
    """(batch with token_rewards/adv/returns, metrics). `kl_coef` is the controller's current value.

    extra_scores: {column: weight} of further per-response scores [B] (user stages with a reward
    weight) added, weighted, to `token_scores` at each response's last token first. cost_coef: safe
    RL's Lagrange multiplier lambda; the score becomes (score - lambda * cost) / (1 + lambda), with
    `cost` [B]. The batch's `token_scores` is then the combined score."""
    mask = batch["response_mask"]
    token_scores = batch["token_scores"].float()
    last = algos.last_index(mask).unsqueeze(1)  # [B, 1]
    metrics: dict[str, float] = {}
    for column, weight in (extra_scores or {}).items():
        token_scores = token_scores.scatter_add(1, last, weight * batch[column].float().unsqueeze(1))
    if cost_coef is not None:
        score = token_scores.sum(-1)
        combined = algos.lagrangian_scores(score, batch["cost"], cost_coef)
        token_scores = torch.zeros_like(token_scores).scatter(1, last, combined.unsqueeze(1))
        metrics.update({"safety/reward/mean": float(score.mean()), "safety/lagrangian_score/mean": float(combined.mean())})
    batch = batch.with_tensors(token_scores=token_scores)
    token_rewards = token_scores
    if cfg.use_kl_in_reward:
        token_rewards, stats = algos.apply_kl_penalty(
            token_scores=token_rewards, logp=batch["old_logp"], ref_logp=batch["ref_logp"],
            response_mask=mask, kl_coef=kl_coef, estimator=cfg.kl_penalty,
        )
        metrics["actor/reward_kl_penalty"] = float(stats["reward_kl_penalty"])
        metrics["actor/reward_kl_penalty_coeff"] = kl_coef
    if cfg.objective == "distill":  # on-policy distillation: each token's advantage is its negated reverse KL
        adv = algos.distillation_advantages(student_logp=batch["rollout_logp"], teacher_logp=batch["teacher_logp"],
                                            response_mask=mask)
        metrics["distill/reverse_kl"] = -float(algos.masked_mean(adv, mask))
        return batch.with_tensors(token_rewards=adv, adv=adv, returns=adv), metrics
    estimator = algos.get_adv_estimator(cfg.adv_estimator)
    adv, returns = estimator(
        token_rewards=token_rewards,
        response_mask=mask,
        group_ids=batch["group_id"],
        values=batch["values"] if "values" in batch else None,
        baseline=batch["baseline_score"] if "baseline_score" in batch else None,
        gamma=cfg.gamma,
        lam=cfg.lam,
        norm_by_std=cfg.norm_adv_by_std,
    )
    out = batch.with_tensors(token_rewards=token_rewards, adv=adv, returns=returns)
    return out, metrics


def data_metrics(batch: Batch, max_new_tokens: int) -> dict[str, float]:
    """verl's data metrics of an iteration: scores, rewards, advantages, returns, values, lengths."""
    mask = batch["response_mask"].bool()
    lengths = response_lengths(batch).float()  # [B] generated and observation tokens: the limit's count
    metrics: dict[str, float] = {}
    per_seq = {
        "critic/score": batch["token_scores"].sum(-1).float(),
        "critic/rewards": batch["token_rewards"].sum(-1).float() if "token_rewards" in batch else None,
        "response_length": lengths,
    }
    per_token = {"critic/advantages": batch.tensors.get("adv"), "critic/returns": batch.tensors.get("returns"),
                 "critic/values": batch.tensors.get("values")}
    stats: dict[str, torch.Tensor] = {}
    for name, seq in per_seq.items():
        if seq is not None:
            stats.update({f"{name}/mean": seq.mean(), f"{name}/max": seq.max(), f"{name}/min": seq.min()})
    for name, tok in per_token.items():
        if tok is not None and mask.any():
            valid = tok[mask]
            stats.update({f"{name}/mean": valid.mean(), f"{name}/max": valid.max(), f"{name}/min": valid.min()})
    stats["response_length/clip_ratio"] = (lengths >= max_new_tokens).float().mean()
    stats["perf/total_num_tokens"] = batch["attention_mask"].sum().float()
    # One conversion to Python numbers for the whole stage.
    values = torch.stack(list(stats.values())).tolist()
    metrics.update(zip(stats.keys(), values))
    return metrics
