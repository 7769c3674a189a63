"""From a scored rollout to advantages and returns: the KL penalty (when KL is a reward term) then the estimator."""

from __future__ import annotations

import torch

from .. import AdvantageInputs, compute_advantages, kl_penalty
from .experience import Rollout


def advantages_for(cfg, rollout: Rollout, kl_coef: float) -> tuple[Rollout, dict[str, float]]:
    """Fill ``advantages`` / ``returns`` (and ``token_rewards``) of ``rollout`` with ``cfg.advantage_estimator``."""
    mask = rollout.action_mask
    token_rewards = None
    if rollout.ref_logprobs is not None and not cfg.use_kl_loss and kl_coef > 0:
        # KL as a reward term (PPO, REINFORCE++): -coef * KL on every response token.
        token_rewards = kl_penalty(rollout.old_logprobs, rollout.ref_logprobs, mask, kl_coef, cfg.kl_estimator)
    inputs = AdvantageInputs(
        response_mask=mask,
        scores=rollout.scores,
        token_rewards=token_rewards,
        values=rollout.values,
        n_samples_per_prompt=cfg.n_samples_per_prompt,
        gamma=cfg.gamma,
        lam=cfg.lambd,
    )
    advantages, returns = compute_advantages(cfg.advantage_estimator, inputs)
    valid = mask.bool()
    stats = {
        "advantage_mean": advantages[valid].mean().item() if valid.any() else 0.0,
        "advantage_std": advantages[valid].std().item() if valid.sum() > 1 else 0.0,
        "return_mean": returns[valid].mean().item() if valid.any() else 0.0,
    }
    if token_rewards is None:
        token_rewards = torch.zeros_like(mask)
    return rollout.with_(advantages=advantages.float(), returns=returns.float(), token_rewards=token_rewards), stats
