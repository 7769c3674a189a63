"""Backward recursions over response tokens: discounted reward-to-go and GAE.

Masked positions are *skipped*, not treated as zero-reward steps: the result at every valid token equals the result
of running the recursion on the sequence with its masked tokens removed. For right-padded responses that is the
usual recursion; for responses with holes (multi-turn rollouts whose tool/observation tokens are masked) it carries
the discount and the bootstrap value across the hole instead of discounting through tokens the policy did not choose.
Outputs are 0 at masked positions. Everything runs in float32 or wider and without gradient.

References: Williams, "Simple statistical gradient-following algorithms" (REINFORCE, 1992); Schulman et al.,
"High-Dimensional Continuous Control Using Generalized Advantage Estimation" (GAE, 2016).
"""

from __future__ import annotations

import torch

from . import _checks
from ._no_grad import no_grad
from .errors import AlgoInputError
from .masked import last_valid_index


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


@no_grad
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_next`` over valid tokens, ``[batch, len]``.

    ``gamma == 1`` is a reverse cumulative sum (exact and loop-free); otherwise one vectorised step per token.
    """
    rewards = _checks.tensor("rewards", rewards, ndim=2, floating=True)
    m = _checks.mask("mask", mask, like=rewards, like_name="rewards")
    gamma = _checks.unit_interval("gamma", gamma)
    _checks.finite([("rewards", rewards, m)], masks=[("mask", mask)])
    r = torch.where(m, rewards.to(_work_dtype(rewards)), 0.0)
    if gamma == 1.0:
        out = r.flip(-1).cumsum(-1).flip(-1)
        return torch.where(m, out, 0.0)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in range(r.shape[1] - 1, -1, -1):
        valid = m[:, t]
        running = torch.where(valid, r[:, t] + gamma * running, running)
        out[:, t] = torch.where(valid, running, 0.0)
    return out


@no_grad
def generalized_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``; returns ``A + V``.

    The value after the last valid token is 0 (the response ended). Returns ``(advantages, returns)``, both
    ``[batch, len]`` and 0 at masked positions. With ``lam = 1`` the returns are the discounted reward-to-go.
    """
    rewards = _checks.tensor("rewards", rewards, ndim=2, floating=True)
    values = _checks.tensor("values", values, ndim=2, floating=True)
    _checks.same_shape("values", values, "rewards", rewards)
    m = _checks.mask("mask", mask, like=rewards, like_name="rewards")
    gamma = _checks.unit_interval("gamma", gamma)
    lam = _checks.unit_interval("lam", lam)
    _checks.finite([("rewards", rewards, m), ("values", values, m)], masks=[("mask", mask)])
    dtype = torch.promote_types(_work_dtype(rewards), _work_dtype(values))
    r = torch.where(m, rewards.to(dtype), 0.0)
    v = torch.where(m, values.to(dtype), 0.0)
    advantages = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=dtype, device=r.device)
    next_adv = torch.zeros_like(next_value)
    for t in range(r.shape[1] - 1, -1, -1):
        valid = m[:, t]
        adv_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        next_adv = torch.where(valid, adv_t, next_adv)
        next_value = torch.where(valid, v[:, t], next_value)
        advantages[:, t] = torch.where(valid, adv_t, 0.0)
    returns = torch.where(m, advantages + v, 0.0)
    return advantages, returns


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's score on its last valid token, 0 elsewhere: ``[batch] -> [batch, len]``.

    A row without any valid token has nowhere to put its score and stays all-zero (it has no action to credit).
    """
    scores = _checks.tensor("scores", scores, ndim=1)
    m = _checks.mask("mask", mask)
    if scores.shape[0] != m.shape[0]:
        raise AlgoInputError(
            "scores",
            f"has {scores.shape[0]} entries for {m.shape[0]} sequences.",
            "Pass one score per sequence (shape [batch]).",
        )
    dtype = torch.promote_types(scores.dtype, torch.float32) if not scores.is_floating_point() else scores.dtype
    last, has_any = last_valid_index(m)
    out = torch.zeros(m.shape, dtype=dtype, device=m.device)
    out.scatter_(1, last[:, None], torch.where(has_any, scores.to(dtype), 0.0)[:, None])
    return out
