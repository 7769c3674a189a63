"""Correcting the mismatch between the inference engine that sampled a rollout and the trainer that learns from it.

The engine (vLLM, SGLang, a bf16 kernel, a stale copy) samples from ``mu``; the trainer computes its loss as if the
samples came from its own policy ``pi_old`` (same weights, other numerics). The gradient is then biased: it
reinforces whatever the engine does differently (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"; Liu, Li et al. 2025, "When Speed Kills Stability"). Importance weights
``rho = pi_old(y) / mu(y)`` from the engine's own log-probs undo it:

- ``tis`` -- truncated IS per token: ``w = min(rho, high)`` (and ``max(., low)`` only if a ``low`` is given).
- ``icepop`` -- IcePop / token-level masked IS (Ling team 2025, "Ring-1T"): ``w = rho`` inside ``[low, high]``,
  0 outside (the token keeps its place in the loss's denominator).
- ``seq-tis`` -- truncated IS per sequence: ``w = min(prod_t rho_t, high)`` on every token of the sequence.
- ``seq-mis`` -- masked IS per sequence: ``w = prod_t rho_t`` for sequences whose product is inside
  ``[low, high]``, 0 for the whole sequence otherwise.
- ``seq-mask-tis`` -- OpenRLHF's: sequences whose *geometric-mean* ratio is outside ``[low, high]`` are dropped,
  the others get token-level ``clip(rho, low, high)``.

Why a lower bound matters less than it seems: the drift an uncorrected run shows comes from tokens the engine
samples far more often than the trainer would (``rho << 1``, e.g. a kernel glitch); every update pushes their
trainer log-prob further down, without end. ``tis`` keeps their small weight; clamping it *up* to a lower bound
(``low = 0.5``) brings the drift back, which is why ``tis`` has no lower bound unless one is given
(the experiment is in the package README).

:func:`rollout_correction` returns the weights (detached, 0 at masked or rejected positions) to pass as
``is_weights`` to :func:`hybrid_algos.compute_policy_loss`, which multiplies them into the per-token loss, and the
statistics that show the gap (``ratio_mean``/``min``/``max`` of ``rho``, ``clipped_frac``, ``masked_frac``,
``kl`` = k1 estimate of KL(engine || trainer), ``k3_kl``). Both log-probs must be of the same distribution (the
engine's raw log-probs against the trainer's at temperature 1, or both tempered).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks
from ._no_grad import no_grad
from .errors import AlgoInputError

LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class RolloutCorrection:
    """A correction method: which ratio weights the loss (and how), which ratio rejects samples, default bounds."""

    name: str
    summary: str
    weight_level: str | None  # token | sequence | None (weight 1)
    truncate: bool  # clamp the weight into [low, high] (TIS) instead of using it as is
    reject_level: str | None  # token | sequence | geometric | None (nothing rejected)
    low: float | None  # default lower bound (None: none)
    high: float  # default upper bound


_METHODS: dict[str, RolloutCorrection] = {}


def register_rollout_correction(
    name: str,
    summary: str,
    *,
    weight_level: str | None,
    truncate: bool,
    reject_level: str | None,
    low: float | None,
    high: float,
    replace: bool = False,
) -> RolloutCorrection:
    """Add a correction method built from the parts above (see the module docstring for the built-in ones)."""
    for field, level in (("weight_level", weight_level), ("reject_level", reject_level)):
        if level is not None and level not in LEVELS:
            raise AlgoInputError(field, f"unknown level {level!r}.", f"Use one of {LEVELS} or None.")
    if name in _METHODS and not replace:
        raise AlgoInputError("name", f"rollout correction {name!r} is already registered.", "Pass replace=True.")
    _check_bounds(low, high)
    method = RolloutCorrection(name, summary, weight_level, truncate, reject_level, low, high)
    _METHODS[name] = method
    return method


def get_rollout_correction(name: str) -> RolloutCorrection:
    if name not in _METHODS:
        raise AlgoInputError(
            "vllm_is_correction_type",
            f"unknown rollout correction {name!r}.",
            f"Choose one of: {', '.join(list_rollout_corrections())}.",
        )
    return _METHODS[name]


def list_rollout_corrections() -> list[str]:
    return sorted(_METHODS)


def _check_bounds(low: float | None, high: float) -> None:
    if not (high > 0 and high < float("inf")):
        raise AlgoInputError("high", f"the upper bound must be a finite number > 0, got {high}.", "Typical: 2.0.")
    if low is not None and not 0 <= low < high:
        raise AlgoInputError("low", f"the lower bound must be in [0, high={high}), got {low}.", "Typical: 0.5.")


@dataclass(frozen=True)
class Correction:
    """What :func:`rollout_correction` returns."""

    weights: torch.Tensor  # [batch, len] float32, detached; 0 at masked and rejected positions
    keep: torch.Tensor  # [batch, len] bool: valid and not rejected
    stats: dict[str, torch.Tensor]  # detached scalars over valid tokens (see the module docstring)


@no_grad
def rollout_correction(
    old_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    method: str = "tis",
    *,
    low: float | None = None,
    high: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> Correction:
    """Importance weights ``pi_old / mu`` of the sampled tokens, truncated or masked as ``method`` says.

    ``old_logprobs``: the trainer's log-probs of the sampled tokens with the weights the engine sampled with;
    ``engine_logprobs``: the engine's own. ``low`` / ``high`` default to the method's bounds (``low`` = None keeps
    the method's default; pass ``low=0.0`` for "no lower bound" explicitly where the method has one).
    """
    spec = get_rollout_correction(method)
    low = spec.low if low is None else low
    high = spec.high if high is None else high
    _check_bounds(low, high)
    old = _checks.tensor("old_logprobs", old_logprobs, ndim=2, floating=True)
    _checks.same_shape(
        "engine_logprobs",
        _checks.tensor("engine_logprobs", engine_logprobs, ndim=2, floating=True),
        "old_logprobs",
        old,
    )
    valid = _checks.mask("mask", mask, like=old, like_name="old_logprobs")
    _checks.finite([("old_logprobs", old, valid), ("engine_logprobs", engine_logprobs, valid)], masks=[("mask", mask)])

    dtype = torch.promote_types(old.dtype, torch.float32)
    log_ratio = torch.where(valid, old.to(dtype) - engine_logprobs.to(dtype), 0.0)
    lengths = valid.sum(-1, keepdim=True)
    seq_log_ratio = log_ratio.sum(-1, keepdim=True)

    def ratio_at(level: str) -> torch.Tensor:
        if level == "token":
            lr = log_ratio
        elif level == "sequence":
            lr = seq_log_ratio.expand_as(log_ratio)
        else:  # geometric mean of the token ratios
            lr = (seq_log_ratio / lengths.clamp(min=1)).expand_as(log_ratio)
        return torch.exp(lr.clamp(-log_ratio_clamp, log_ratio_clamp))

    weights = torch.ones_like(log_ratio)
    clipped = torch.zeros_like(valid)
    if spec.weight_level is not None:
        raw = ratio_at(spec.weight_level)
        weights = raw
        if spec.truncate:
            weights = raw.clamp(min=low if low is not None else 0.0, max=high)
            clipped = weights != raw
    rejected = torch.zeros_like(valid)
    if spec.reject_level is not None:
        q = ratio_at(spec.reject_level)
        rejected = (q > high) | ((q < low) if low is not None else torch.zeros_like(valid))
    keep = valid & ~rejected
    weights = torch.where(keep, weights, 0.0)

    n = valid.sum()
    denom = n.clamp(min=1)
    rho = torch.exp(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))
    neutral = rho.new_ones(())
    stats = {
        "ratio_mean": torch.where(valid, rho, 0.0).sum() / denom,
        # no valid token: 1 (neutral); chosen on the device, so the stats never wait for the GPU
        "ratio_min": torch.where(n > 0, torch.where(valid, rho, torch.inf).amin(), neutral),
        "ratio_max": torch.where(n > 0, torch.where(valid, rho, -torch.inf).amax(), neutral),
        "weight_mean": weights.sum() / denom,
        "clipped_frac": (clipped & keep).sum() / denom,
        "masked_frac": (valid & rejected).sum() / denom,
        "kl": -log_ratio.sum() / denom,  # k1 of KL(engine || trainer) on the engine's samples
        "k3_kl": torch.where(valid, rho - 1 - log_ratio, 0.0).sum() / denom,
        "tokens": n.to(dtype),
    }
    return Correction(weights.detach(), keep, stats)


register_rollout_correction(
    "tis",
    "truncated IS per token: min(rho, high) (a lower bound only if given)",
    weight_level="token",
    truncate=True,
    reject_level=None,
    low=None,
    high=2.0,
)
register_rollout_correction(
    "icepop",
    "IcePop: token IS weight rho inside [low, high], 0 outside",
    weight_level="token",
    truncate=False,
    reject_level="token",
    low=0.5,
    high=5.0,
)
register_rollout_correction(
    "seq-tis",
    "truncated IS per sequence: min(prod rho, high) on every token",
    weight_level="sequence",
    truncate=True,
    reject_level=None,
    low=None,
    high=5.0,
)
register_rollout_correction(
    "seq-mis",
    "masked IS per sequence: prod rho, whole sequences outside [low, high] dropped",
    weight_level="sequence",
    truncate=False,
    reject_level="sequence",
    low=0.5,
    high=2.0,
)
register_rollout_correction(
    "seq-mask-tis",
    "OpenRLHF's: drop sequences by geometric-mean rho, token clip(rho, low, high)",
    weight_level="token",
    truncate=True,
    reject_level="geometric",
    low=0.5,
    high=5.0,
)
