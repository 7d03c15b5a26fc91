"""Pure tensor math for RL post-training: masked statistics, advantage estimators, policy and
value losses, KL estimators and controllers.

Imports torch and the standard library only (checked by tests/algos/test_imports.py).
Shapes everywhere: B batch (responses), T response tokens, G groups, V vocabulary.
"""

from engine.algos.advantages import (
    ADV_ESTIMATORS,
    AdvEstimator,
    AdvEstimatorFn,
    AdvInputs,
    dr_grpo,
    gae,
    get_adv_estimator,
    group_mean_std,
    grpo,
    outcome_scores,
    register_adv_estimator,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from engine.algos.agg import LOSS_AGG_MODES, agg_loss, agg_units
from engine.algos.correction import rollout_correction
from engine.algos.distill import distillation_advantages
from engine.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    kl_abs,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
    kl_penalty,
)
from engine.algos.lagrange import lagrangian_scores, update_multiplier
from engine.algos.masked import (
    entropy_from_logits,
    last_index,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from engine.algos.policy_loss import (
    POLICY_LOSSES,
    LossInputs,
    PolicyLoss,
    PolicyLossFn,
    get_policy_loss,
    gspo,
    ppo_clip,
    register_policy_loss,
)
from engine.algos.preference import PREFERENCE_LOSSES, preference_loss, sequence_logp
from engine.algos.value import clipped_value_loss

__all__ = [
    "last_index",
    "distillation_advantages",
    "PREFERENCE_LOSSES",
    "preference_loss",
    "sequence_logp",
    "lagrangian_scores",
    "update_multiplier",
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvEstimator",
    "AdvEstimatorFn",
    "AdvInputs",
    "FixedKLController",
    "KLController",
    "LossInputs",
    "PolicyLoss",
    "PolicyLossFn",
    "agg_loss",
    "agg_units",
    "apply_kl_penalty",
    "clipped_value_loss",
    "dr_grpo",
    "entropy_from_logits",
    "gae",
    "get_adv_estimator",
    "get_policy_loss",
    "group_mean_std",
    "grpo",
    "gspo",
    "kl_abs",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "outcome_scores",
    "ppo_clip",
    "register_adv_estimator",
    "register_policy_loss",
    "rollout_correction",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]
