"""PPO's clipped value (critic) loss.

Per valid token, with returns ``R`` (GAE targets), new values ``V`` and the values ``V_old`` seen at rollout time:

    loss = 0.5 * max((V - R)**2, (V_old + clip(V - V_old, -clip, clip) - R)**2)

The clipped term keeps the critic from moving far from its rollout-time estimate in one update (OpenAI baselines'
PPO2; studied in Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients", and Andrychowicz et al.
2021, "What Matters in On-Policy RL", which found it can also hurt -- ``clip=None`` turns it off).
"""

from __future__ import annotations

import torch

from . import _checks
from .aggregation import aggregate_loss, check_agg_mode
from .masked import masked_var


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
    agg_mode: str = "token-mean",
    norm_len: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The (clipped) squared error of the critic, aggregated with ``agg_mode``; gradients flow through ``values``.

    Returns ``(loss, stats)`` with detached scalars over valid tokens: ``clip_frac`` (tokens where the clipped term
    is the larger), ``values_mean`` and ``explained_variance`` (``1 - Var(R - V) / Var(R)``; 1 is a perfect critic).
    """
    check_agg_mode(agg_mode)
    if clip is not None:
        clip = _checks.positive_float("value_clip", clip)
    values = _checks.tensor("values", values, ndim=2, floating=True)
    for name, x in (("old_values", old_values), ("returns", returns)):
        _checks.same_shape(name, _checks.tensor(name, x, ndim=2, floating=True), "values", values)
    valid = _checks.mask("mask", mask, like=values, like_name="values")
    _checks.finite(
        [("values", values, valid), ("old_values", old_values, valid), ("returns", returns, valid)],
        masks=[("mask", mask)],
    )

    dtype = torch.promote_types(values.dtype, torch.float32)
    v = torch.where(valid, values.to(dtype), 0.0)
    target = torch.where(valid, returns.detach().to(dtype), 0.0)
    unclipped = (v - target).square()
    clip_active = torch.zeros_like(valid)
    per_token = unclipped
    if clip is not None:
        old = torch.where(valid, old_values.detach().to(dtype), 0.0)
        clipped = (old + (v - old).clamp(-clip, clip) - target).square()
        clip_active = clipped > unclipped
        per_token = torch.maximum(unclipped, clipped)
    loss = 0.5 * aggregate_loss(per_token, valid, agg_mode, norm_len)

    with torch.no_grad():
        n = valid.sum().clamp(min=1)
        vd, td = v.detach(), target
        var_target = masked_var(td, valid, unbiased=False)
        stats = {
            "clip_frac": (clip_active & valid).sum() / n,
            "values_mean": vd.sum() / n,
            "explained_variance": 1.0 - masked_var(td - vd, valid, unbiased=False) / var_target.clamp(min=1e-8),
        }
    return loss, stats
