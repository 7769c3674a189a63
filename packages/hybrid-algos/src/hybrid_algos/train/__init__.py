"""The colocated training loop (install ``hybrid-algos[train]``): roles on Ray, engines, DeepSpeed, sleep/wake.

Pick a recipe and a config::

    from hybrid_algos.train import GRPOConfig, train_grpo
    summary = train_grpo(GRPOConfig(max_steps=40))   # the tiny built-in model and task on the CPU
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .config import CONFIGS, GRPOConfig, PPOConfig, ReinforceConfig, RLConfig, demo_config


def train(config: RLConfig, *, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Run the job described by ``config`` (any :class:`RLConfig`); see :mod:`hybrid_algos.train.loop`.

    The one entry to the loop: the recipes below and the CLI (``hybrid ppo`` -> :func:`train_ppo`) come through here.
    The loop is imported on the first call: it pulls in Ray, DeepSpeed and the engines.
    """
    from .loop import train as _train

    return _train(config, callbacks=callbacks)


def train_ppo(config: PPOConfig | None = None, *, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """PPO: actor + GAE critic + reference (KL in the reward) + reward, colocated with sleep; the demo without a config.

    Like OpenRLHF's ``train_ppo_ray``, it runs any advantage estimator: a critic is trained only when the estimator
    needs one (its registry entry says so), so ``PPOConfig(advantage_estimator="group_norm")`` is GRPO-style PPO.
    ``hybrid ppo`` runs this same function.
    """
    return train(config or demo_config(PPOConfig), callbacks=callbacks)


def train_grpo(config: GRPOConfig | None = None, *, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """GRPO: actor + reference (KL as a loss term), group-normalised rewards, no critic; the demo without a config."""
    return train(config or demo_config(GRPOConfig), callbacks=callbacks)


def train_reinforce(config: ReinforceConfig | None = None, *, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """REINFORCE++: actor + reference (KL in the reward), batch-normalised discounted returns, no critic; the demo
    without a config."""
    return train(config or demo_config(ReinforceConfig), callbacks=callbacks)


#: command -> its training function (``hybrid ppo`` -> :func:`train_ppo`); what each runs is its recipe
#: (:mod:`.recipes`: the roles and phases as data)
TRAINERS: dict[str, Callable[..., dict[str, Any]]] = {
    "ppo": train_ppo,
    "grpo": train_grpo,
    "reinforce": train_reinforce,
}

__all__ = [
    "CONFIGS",
    "TRAINERS",
    "GRPOConfig",
    "PPOConfig",
    "RLConfig",
    "ReinforceConfig",
    "train",
    "train_grpo",
    "train_ppo",
    "train_reinforce",
]
