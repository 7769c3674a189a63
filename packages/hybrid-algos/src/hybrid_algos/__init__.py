"""hybrid_algos: the math of PPO, REINFORCE++, GRPO, Dr. GRPO and RLOO in plain torch.

Importing this package loads torch and nothing else; the training loop is :mod:`hybrid_algos.train` (the
``[train]`` extra) and is never imported from here.

- advantages: :class:`AdvantageInputs`, :func:`compute_advantages` and the estimator registry
  (:func:`register_advantage_estimator`, :func:`get_advantage_estimator`, :func:`list_advantage_estimators`).
- KL: :func:`kl_estimate` (k1/k2/k3), :func:`kl_penalty`, :func:`kl_penalty_rewards`, KL controllers.
- policy losses behind a registry (:func:`compute_policy_loss`, :func:`register_policy_loss`; built in: ``ppo``,
  ``gspo``, ``cispo``, ``dr_grpo``), :func:`ppo_policy_loss`, :func:`clipped_value_loss`,
  :func:`entropy_from_logits`, :func:`aggregate_loss`.
- engine/trainer mismatch: :func:`rollout_correction` (TIS, IcePop, sequence-level TIS / MIS) and its metrics.
- DAPO: :func:`informative_groups` (dynamic sampling), :func:`overlong_penalty`.
- on-policy distillation: :func:`distillation_advantages` (the teacher's per-token reverse KL as the advantage).
- helpers: masked statistics, discounted returns and GAE, :func:`logprobs_from_logits`.

Bad input raises :class:`AlgoInputError` (a ``ValueError``) naming the argument and the fix.
"""

from ._checks import set_value_checks
from .advantages import (
    AdvantageEstimator,
    AdvantageInputs,
    compute_advantages,
    get_advantage_estimator,
    list_advantage_estimators,
    register_advantage_estimator,
)
from .aggregation import LOSS_AGG_MODES, aggregate_loss
from .dapo import informative_groups, overlong_penalty
from .distillation import distillation_advantages
from .entropy import entropy_from_logits, logprobs_from_logits
from .errors import AlgoInputError
from .kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalty,
    kl_penalty_rewards,
    make_kl_controller,
)
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .mismatch import (
    Correction,
    RolloutCorrection,
    get_rollout_correction,
    list_rollout_corrections,
    register_rollout_correction,
    rollout_correction,
)
from .policy_loss import (
    PolicyLoss,
    PolicyLossInputs,
    compute_policy_loss,
    get_policy_loss,
    list_policy_losses,
    ppo_policy_loss,
    register_policy_loss,
)
from .returns import discounted_returns, generalized_advantages, scores_to_token_rewards
from .value_loss import clipped_value_loss

__version__ = "0.1.0"

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AlgoInputError",
    "Correction",
    "FixedKLController",
    "PolicyLoss",
    "PolicyLossInputs",
    "RolloutCorrection",
    "aggregate_loss",
    "clipped_value_loss",
    "compute_advantages",
    "compute_policy_loss",
    "discounted_returns",
    "distillation_advantages",
    "entropy_from_logits",
    "generalized_advantages",
    "get_advantage_estimator",
    "get_policy_loss",
    "get_rollout_correction",
    "informative_groups",
    "kl_estimate",
    "kl_penalty",
    "kl_penalty_rewards",
    "list_advantage_estimators",
    "list_policy_losses",
    "list_rollout_corrections",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "ppo_policy_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "register_rollout_correction",
    "rollout_correction",
    "scores_to_token_rewards",
    "set_value_checks",
]
