"""ppoflow.algos: the PPO math as pure torch functions (no I/O, no torch.distributed).

masked.py         masked_sum / masked_mean / masked_var / masked_whiten
logits.py         entropy_from_logits, logprobs_from_logits
losses.py         agg_loss, compute_policy_loss, compute_value_loss, compute_entropy_loss
advantages.py     GAE, GRPO, RLOO, REINFORCE++ (+ baseline), distill, the ADV_ESTIMATORS registry
policy_losses.py  vanilla / GSPO / GSPO-token / CISPO, the POLICY_LOSSES registry
shaping.py        DAPO's overlong penalty, truncated rows, informative groups (dynamic sampling)
kl.py             kl_penalty, Fixed/AdaptiveKLController, apply_kl_penalty, teacher_rewards
mismatch.py       how far the rollout engine's policy is from the trainer's (k1/k3 KL, token_mult_prob_error, ...)
correction.py     truncated importance sampling (TIS) and rejection (MIS) between the two
"""

from ppoflow.algos.advantages import (
    ADV_ESTIMATORS,
    compute_advantage,
    compute_distill_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_reinforce_plus_plus_baseline_advantage,
    compute_rloo_outcome_advantage,
    estimator_inputs,
    estimator_reads_values,
    get_adv_estimator,
    register_adv_estimator,
)
from ppoflow.algos.correction import (
    MIS_LEVELS,
    TIS_LEVELS,
    correction_metrics,
    rejection_mask,
    truncated_is_weights,
)
from ppoflow.algos.kl import (
    KL_CONTROLLERS,
    KL_PENALTY_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
    teacher_rewards,
)
from ppoflow.algos.logits import entropy_from_logits, logprobs_from_logits
from ppoflow.algos.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
)
from ppoflow.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from ppoflow.algos.mismatch import MISMATCH_BOUNDS, mismatch_metrics
from ppoflow.algos.policy_losses import (
    POLICY_LOSSES,
    cispo_policy_loss,
    get_policy_loss,
    gspo_policy_loss,
    gspo_token_policy_loss,
    register_policy_loss,
    vanilla_policy_loss,
)
from ppoflow.algos.shaping import informative_groups, overlong_penalty, truncated_rows

__all__ = [
    "ADV_ESTIMATORS",
    "estimator_inputs",
    "estimator_reads_values",
    "KL_CONTROLLERS",
    "KL_PENALTY_KINDS",
    "LOSS_AGG_MODES",
    "MISMATCH_BOUNDS",
    "MIS_LEVELS",
    "POLICY_LOSSES",
    "TIS_LEVELS",
    "correction_metrics",
    "mismatch_metrics",
    "rejection_mask",
    "truncated_is_weights",
    "cispo_policy_loss",
    "get_policy_loss",
    "gspo_policy_loss",
    "gspo_token_policy_loss",
    "register_policy_loss",
    "vanilla_policy_loss",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_distill_advantage",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator",
    "informative_groups",
    "overlong_penalty",
    "truncated_rows",
    "get_kl_controller",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_estimator",
    "teacher_rewards",
]
