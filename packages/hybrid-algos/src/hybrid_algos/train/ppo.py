"""PPO recipe: actor + GAE critic + reference (KL in the reward) + reward, colocated with sleep.

    from hybrid_algos.train import PPOConfig, train_ppo
    summary = train_ppo(PPOConfig(max_steps=40))
"""

from __future__ import annotations

from typing import Any, Sequence

from .config import PPOConfig, demo_config
from .loop import train


def train_ppo(config: PPOConfig | None = None, *, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    config = config or demo_config(PPOConfig)
    if not config.uses_critic:
        raise ValueError(f"PPO trains a critic: advantage_estimator must be 'gae', got {config.advantage_estimator!r}")
    return train(config, callbacks=callbacks)
