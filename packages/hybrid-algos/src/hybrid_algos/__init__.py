"""hybrid_algos: the math of PPO, REINFORCE++, GRPO, Dr. GRPO and RLOO in plain torch.

Importing this package loads torch and nothing else; the training loop is :mod:`hybrid_algos.train` (the
``[train]`` extra) and is never imported from here.

- advantages: :class:`AdvantageInputs`, :func:`compute_advantages` and the estimator registry
  (:func:`register_advantage_estimator`, :func:`get_advantage_estimator`, :func:`list_advantage_estimators`).
- KL: :func:`kl_estimate` (k1/k2/k3), :func:`kl_penalty`, :func:`kl_penalty_rewards`, KL controllers.
- losses: :func:`ppo_policy_loss`, :func:`clipped_value_loss`, :func:`entropy_from_logits`,
  :func:`aggregate_loss`.
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
from .policy_loss import ppo_policy_loss
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
    "FixedKLController",
    "aggregate_loss",
    "clipped_value_loss",
    "compute_advantages",
    "discounted_returns",
    "entropy_from_logits",
    "generalized_advantages",
    "get_advantage_estimator",
    "kl_estimate",
    "kl_penalty",
    "kl_penalty_rewards",
    "list_advantage_estimators",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "register_advantage_estimator",
    "scores_to_token_rewards",
    "set_value_checks",
]
