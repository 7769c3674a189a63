"""PPO's clipped surrogate policy loss, with asymmetric ("clip-higher") and dual clipping.

Per valid token, with ``ratio = exp(logprobs - old_logprobs)`` and advantage ``A``
(Schulman et al. 2017, "Proximal Policy Optimization Algorithms"):

    loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))

- Asymmetric clip (DAPO's clip-higher, Yu et al. 2025, arXiv:2503.14476): ``clip_high > clip_low`` leaves more
  room to raise the probability of unlikely tokens, against entropy collapse. ``clip_high=None`` means symmetric.
- Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"): for
  ``A < 0`` the loss above is unbounded as the ratio grows; ``dual_clip = c > 1`` caps it at ``-A * c``.

The ratio is formed in log space and the log-ratio clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before the
``exp`` (an fp overflow guard; such tokens are clipped anyway). Masked positions are zeroed *before* the ``exp`` so
padding can carry anything (even NaN) without touching the loss or its gradient.
"""

from __future__ import annotations

import torch

from . import _checks
from .aggregation import aggregate_loss, check_agg_mode
from .errors import AlgoInputError


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise AlgoInputError("clip_low", f"must be in [0, 1), got {clip_low}.", "Typical: 0.2.")
    if not clip_high >= 0.0:
        raise AlgoInputError("clip_high", f"must be >= 0, got {clip_high}.", "Typical: 0.2, or 0.28 for clip-higher.")
    if dual_clip is not None and not dual_clip > 1.0:
        raise AlgoInputError("dual_clip", f"must be > 1 (it caps the loss at -A * dual_clip), got {dual_clip}.",
                             "Typical: 3.0, or None to turn it off.")


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float | None = None,
                    dual_clip: float | None = None, agg_mode: str = "token-mean", norm_len: float | None = None,
                    log_ratio_clamp: float = 20.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate, aggregated with ``agg_mode`` (see :mod:`hybrid_algos.aggregation`).

    Shapes ``[batch, len]``; gradients flow through ``logprobs`` only. Returns ``(loss, stats)``; ``stats`` holds
    detached scalars over valid tokens: ``clip_frac`` (tokens where clipping is active), ``dual_clip_frac``,
    ``approx_kl`` (k3 estimate of KL(old || new)) and ``ratio_mean``, ``ratio_max``.
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check_clip(clip_low, clip_high, dual_clip)
    check_agg_mode(agg_mode)
    _checks.positive_float("log_ratio_clamp", log_ratio_clamp)
    logprobs = _checks.tensor("logprobs", logprobs, ndim=2, floating=True)
    for name, x in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        _checks.same_shape(name, _checks.tensor(name, x, ndim=2, floating=True), "logprobs", logprobs)
    valid = _checks.mask("mask", mask, like=logprobs, like_name="logprobs")
    _checks.finite([("logprobs", logprobs, valid), ("old_logprobs", old_logprobs, valid),
                    ("advantages", advantages, valid)], masks=[("mask", mask)])

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    adv = torch.where(valid, advantages.detach().to(dtype), 0.0)
    log_ratio = torch.where(valid, logprobs.to(dtype) - old_logprobs.detach().to(dtype), 0.0)
    log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(valid)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual_active, cap, per_token)
    loss = aggregate_loss(per_token, valid, agg_mode, norm_len)

    with torch.no_grad():
        n = valid.sum().clamp(min=1)
        r = ratio.detach()
        stats = {
            "clip_frac": ((clipped > unclipped) & valid).sum() / n,
            "dual_clip_frac": (dual_active & valid).sum() / n,
            "approx_kl": torch.where(valid, (r - 1) - log_ratio.detach(), 0.0).sum() / n,
            "ratio_mean": torch.where(valid, r, 0.0).sum() / n,
            "ratio_max": torch.where(valid, r, 0.0).amax() if r.numel() else r.new_zeros(()),
        }
    return loss, stats
