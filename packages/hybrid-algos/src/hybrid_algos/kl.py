"""KL(pi || pi_ref) per token, as a reward penalty or a loss term, and the controllers of its coefficient.

Estimators (John Schulman, "Approximating KL Divergence", 2020), from tokens sampled from pi, with
``log_ratio = log pi(y) - log pi_ref(y)`` and ``r = pi_ref(y) / pi(y) = exp(-log_ratio)``:

- ``k1 = log_ratio`` -- unbiased, high variance, can be negative per token.
- ``k2 = log_ratio**2 / 2`` -- biased, low variance, >= 0. As a *loss*, its gradient is the on-policy gradient of
  KL(pi || pi_ref) (k1's gradient is 0 in expectation, so k1 is a reward penalty, not a loss).
- ``k3 = (r - 1) - log r`` -- unbiased, low variance, >= 0; the "low_var_kl" of GRPO (Shao et al. 2024). ``exp``
  makes it explode for large |log_ratio|, so the log-ratio is clamped to ``[-20, 20]`` before the ``exp`` and the
  result to ``[0, 10]``, as verl and OpenRLHF do.

Aliases accepted: ``kl`` (k1), ``mse`` (k2), ``low_var_kl`` (k3).

As a reward penalty (PPO, REINFORCE++; Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences";
Ouyang et al. 2022): :func:`kl_penalty` gives ``-coef * KL`` per token, :func:`kl_penalty_rewards` adds the score on
the last valid token. As a loss term (GRPO): ``aggregate_loss(kl_estimate(logprobs, ref_logprobs, "k3"), mask)``.

The coefficient: :class:`FixedKLController`, or :class:`AdaptiveKLController` (Ziegler et al. 2019, section 2.2):
``e = clip(KL / target - 1, -0.2, 0.2)``, ``coef <- coef * (1 + e * n_steps / horizon)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import _checks
from ._no_grad import no_grad
from .errors import AlgoInputError
from .returns import scores_to_token_rewards

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_ESTIMATOR_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def _estimator_name(estimator: str) -> str:
    name = KL_ESTIMATOR_ALIASES.get(estimator, estimator)
    if name not in KL_ESTIMATORS:
        known = ", ".join([*KL_ESTIMATORS, *KL_ESTIMATOR_ALIASES])
        raise AlgoInputError("kl_estimator", f"unknown KL estimator {estimator!r}.", f"Choose one of: {known}.")
    return name


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    *,
    mask: torch.Tensor | None = None,
    log_ratio_clamp: float | None = 20.0,
    max_value: float | None = 10.0,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref), ``[batch, len]``, differentiable w.r.t. ``logprobs``.

    ``log_ratio_clamp`` and ``max_value`` apply to k3 only (None turns them off). With ``mask``, masked positions
    are 0 whatever the inputs hold there. Computed in float32 or wider.
    """
    name = _estimator_name(estimator)
    logprobs = _checks.tensor("logprobs", logprobs, floating=True)
    ref_logprobs = _checks.tensor("ref_logprobs", ref_logprobs, floating=True)
    _checks.same_shape("ref_logprobs", ref_logprobs, "logprobs", logprobs)
    valid = None
    if mask is not None:
        valid = _checks.mask("mask", mask, like=logprobs, like_name="logprobs")
        _checks.finite([("logprobs", logprobs, valid), ("ref_logprobs", ref_logprobs, valid)], masks=[("mask", mask)])
    dtype = torch.promote_types(torch.promote_types(logprobs.dtype, ref_logprobs.dtype), torch.float32)
    log_ratio = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if valid is not None:
        log_ratio = torch.where(valid, log_ratio, 0.0)
    if name == "k1":
        kl = log_ratio
    elif name == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        if log_ratio_clamp is not None:
            log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
        kl = _k3(log_ratio).clamp(min=0.0, max=max_value)
    return kl if valid is None else torch.where(valid, kl, 0.0)


#: Below this |log_ratio|, k3 is taken from its Taylor series (see :func:`_k3`).
_K3_SERIES_BELOW = 1e-2


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(-x) - 1 + x``, accurate and >= 0 near ``x = 0`` in float32.

    Written directly, ``exp(-x)`` carries a rounding error of ~3e-8 while the true value is ``x**2 / 2`` (5e-9 at
    ``x = 1e-4``): about half such tokens come out slightly negative, and a ``clamp(min=0)`` then zeroes their
    gradient -- exactly the tokens of a policy close to its reference. Near 0 the series
    ``x**2/2 - x**3/6 + x**4/24`` (truncation error ``x**5/120``, below float32's precision for ``|x| < 1e-2``) is
    used instead; elsewhere ``expm1(-x) + x``, whose terms no longer cancel.
    """
    small = log_ratio.abs() < _K3_SERIES_BELOW
    x = torch.where(small, log_ratio, 0.0)  # keeps the unused branch's gradient finite
    series = x * x * (0.5 - x * (1.0 / 6.0 - x / 24.0))
    direct = torch.expm1(-log_ratio) + log_ratio
    return torch.where(small, series, direct)


@no_grad
def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kl_coef: float, estimator: str = "k1"
) -> torch.Tensor:
    """``-kl_coef * KL`` per valid token (0 elsewhere), detached: the dense reward of KL-penalised RLHF."""
    kl_coef = _checks.positive_float("kl_coef", kl_coef, allow_zero=True)
    return -kl_coef * kl_estimate(logprobs, ref_logprobs, estimator, mask=mask)


@no_grad
def kl_penalty_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> torch.Tensor:
    """Full per-token rewards: each score on its last valid token, ``-kl_coef * KL`` on every valid token.

    Pass the result as ``AdvantageInputs(token_rewards=...)`` with ``scores=None`` (it already holds the scores).
    """
    penalty = kl_penalty(logprobs, ref_logprobs, mask, kl_coef, estimator)
    _checks.finite([("scores", scores, None)])
    return penalty + scores_to_token_rewards(scores, mask).to(penalty.dtype)


class FixedKLController:
    """A constant KL coefficient; ``update`` does nothing (same interface as :class:`AdaptiveKLController`)."""

    def __init__(self, kl_coef: float):
        self.value = _checks.positive_float("kl_coef", kl_coef, allow_zero=True)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"


class AdaptiveKLController:
    """Ziegler et al. 2019: steer the measured KL to ``target`` with a clipped proportional update.

    After each batch, ``update(kl, n_steps)`` with the batch's mean KL (per sequence, summed over tokens, as in the
    paper's KL(pi || pi_ref) per sample) and the number of samples it covered.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value = _checks.positive_float("init_kl_coef", init_kl_coef)
        self.target = _checks.positive_float("kl_target", target)
        self.horizon = _checks.positive_float("kl_horizon", horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise AlgoInputError(
                "current_kl",
                f"must be finite, got {current_kl}.",
                "A NaN/inf KL would freeze the coefficient at NaN; check the log-probs.",
            )
        if n_steps < 0:
            raise AlgoInputError("n_steps", f"must be >= 0, got {n_steps}.")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target={self.target}, horizon={self.horizon})"


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(init_kl_coef: float, target: float | None = None, horizon: int = 10000) -> KLController:
    """Adaptive when a ``target`` KL is given, fixed otherwise."""
    if target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, target, horizon)
