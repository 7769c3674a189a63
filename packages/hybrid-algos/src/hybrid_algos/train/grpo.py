"""GRPO recipe: actor + reference (KL as a loss term), group-normalised rewards, no critic.

    from hybrid_algos.train import GRPOConfig, train_grpo
    summary = train_grpo(GRPOConfig(n_samples_per_prompt=8, max_steps=40))
"""

from __future__ import annotations

from typing import Any, Sequence

from .config import GRPOConfig, demo_config


def train_grpo(config: GRPOConfig | None = None, *, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    from . import train  # hybrid_algos.train.train: the one entry to the loop (the CLI comes through here too)

    return train(config or demo_config(GRPOConfig), callbacks=callbacks)
