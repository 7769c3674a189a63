"""REINFORCE++ recipe: actor + reference (KL in the reward), batch-normalised discounted returns, no critic.

    from hybrid_algos.train import ReinforceConfig, train_reinforce
    summary = train_reinforce(ReinforceConfig(max_steps=40))
"""

from __future__ import annotations

from typing import Any, Sequence

from .config import ReinforceConfig, demo_config


def train_reinforce(config: ReinforceConfig | None = None, *, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    from . import train  # hybrid_algos.train.train: the one entry to the loop (the CLI comes through here too)

    return train(config or demo_config(ReinforceConfig), callbacks=callbacks)
