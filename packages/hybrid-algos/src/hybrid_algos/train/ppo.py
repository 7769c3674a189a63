"""PPO recipe: actor + GAE critic + reference (KL in the reward) + reward, colocated with sleep.

    from hybrid_algos.train import PPOConfig, train_ppo
    summary = train_ppo(PPOConfig(max_steps=40))

Like OpenRLHF's ``train_ppo_ray``, it runs any advantage estimator: a critic is trained only when the estimator
needs one (its registry entry says so), so ``PPOConfig(advantage_estimator="group_norm")`` is GRPO-style PPO.
``hybrid ppo`` runs this same function.
"""

from __future__ import annotations

from typing import Any, Sequence

from .config import PPOConfig, demo_config


def train_ppo(config: PPOConfig | None = None, *, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    from . import train  # hybrid_algos.train.train: the one entry to the loop (the CLI comes through here too)

    return train(config or demo_config(PPOConfig), callbacks=callbacks)
