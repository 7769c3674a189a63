"""From a scored rollout to advantages and returns: the KL penalty (when KL is a reward term), the estimator, then
the teacher's per-token term (on-policy distillation)."""

from __future__ import annotations

import torch

from .. import AdvantageInputs, compute_advantages, distillation_advantages, kl_penalty
from ..settings import AlgorithmSettings
from .experience import Rollout


def advantages_for(
    algo: AlgorithmSettings,
    rollout: Rollout,
    kl_coef: float,
    *,
    n_samples_per_prompt: int,
    teacher_logprobs: torch.Tensor | None = None,
) -> tuple[Rollout, dict[str, float]]:
    """Fill ``advantages`` / ``returns`` (and ``token_rewards``) of ``rollout`` with ``algo.estimator``
    (``n_samples_per_prompt``: the size of each prompt's group, which the group estimators compare within).

    ``teacher_logprobs`` (a run with a teacher): each token's advantage also gets the teacher's reverse-KL term
    against the rollout's old log-probs (:func:`hybrid_algos.distillation_advantages`); the returns, which a critic
    learns, stay the task's."""
    mask = rollout.action_mask
    token_rewards = None
    if rollout.ref_logprobs is not None and not algo.kl_loss and kl_coef > 0:
        # KL as a reward term (PPO, REINFORCE++): -coef * KL on every response token.
        token_rewards = kl_penalty(rollout.old_logprobs, rollout.ref_logprobs, mask, kl_coef, algo.kl_estimator)
    inputs = AdvantageInputs(
        response_mask=mask,
        scores=rollout.scores,
        token_rewards=token_rewards,
        values=rollout.values,
        n_samples_per_prompt=n_samples_per_prompt,
        gamma=algo.gamma,
        lam=algo.lam,
    )
    advantages, returns = compute_advantages(algo.estimator, inputs)
    valid = mask.bool()
    distill: dict[str, float] = {}
    if teacher_logprobs is not None:
        if rollout.old_logprobs is None:  # TrainSettings.needs_old_logprobs is true with a teacher
            raise ValueError("distillation needs the rollout's old log-probs (the student's side of the term)")
        advantages, reverse_kl = distillation_advantages(
            advantages.float(),
            rollout.old_logprobs.float(),
            teacher_logprobs.float(),
            mask,
            coef=algo.distill_coef,
            task_coef=algo.distill_task_coef,
            group=rollout.group,
        )
        tokens = valid.sum().clamp(min=1)
        distill = {
            "distill/reverse_kl": (reverse_kl.sum() / tokens).item(),
            "distill/teacher_logprob_mean": (teacher_logprobs.float() * mask).sum().item() / tokens.item(),
        }
    stats = {
        "advantage_mean": advantages[valid].mean().item() if valid.any() else 0.0,
        "advantage_std": advantages[valid].std().item() if valid.sum() > 1 else 0.0,
        "return_mean": returns[valid].mean().item() if valid.any() else 0.0,
        **distill,
    }
    if token_rewards is None:
        token_rewards = torch.zeros_like(mask)
    return rollout.with_(advantages=advantages.float(), returns=returns.float(), token_rewards=token_rewards), stats
