"""The colocated training loop (install ``hybrid-algos[train]``): roles on Ray, engines, DeepSpeed, sleep/wake.

Pick a recipe and a config::

    from hybrid_algos.train import GRPOConfig, train_grpo
    summary = train_grpo(GRPOConfig(max_steps=40))   # the tiny built-in model and task on the CPU
"""

from .config import CONFIGS, GRPOConfig, PPOConfig, ReinforceConfig, RLConfig


def train(config, *, callbacks=()):
    """Run the job described by ``config`` (any :class:`RLConfig`); see :mod:`hybrid_algos.train.loop`."""
    from .loop import train as _train

    return _train(config, callbacks=callbacks)


def train_ppo(config=None, *, callbacks=()):
    from .ppo import train_ppo as _f

    return _f(config, callbacks=callbacks)


def train_grpo(config=None, *, callbacks=()):
    from .grpo import train_grpo as _f

    return _f(config, callbacks=callbacks)


def train_reinforce(config=None, *, callbacks=()):
    from .reinforce import train_reinforce as _f

    return _f(config, callbacks=callbacks)


RECIPES = {"ppo": train_ppo, "grpo": train_grpo, "reinforce": train_reinforce}

__all__ = ["CONFIGS", "GRPOConfig", "PPOConfig", "RECIPES", "ReinforceConfig", "RLConfig", "train", "train_grpo",
           "train_ppo", "train_reinforce"]
