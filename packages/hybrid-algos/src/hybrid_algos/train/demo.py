"""The built-in demo's settings (no ``--pretrain``): what ``hybrid ppo`` / ``hybrid grpo`` / ``hybrid reinforce`` run
on the tiny model and task, and what :func:`~hybrid_algos.train.config.demo_config` applies.

A module of its own, below :mod:`.config` and :mod:`.inactive`: both read it (the latter to tell a value the user
chose from the demo's).
"""

from __future__ import annotations

from typing import Any

#: Settings of the built-in demo (no --pretrain): the tiny model learns to copy the prompt's symbol, from chance to
#: >= 0.9 in ~12-25 steps of about a second on a CPU, with PPO, REINFORCE++ and GRPO, whatever the seed or CPU (the
#: CPU learning test runs exactly these, three seeds each). Adam's beta2 is 0.999 (OpenRLHF: 0.95) and 16 samples per
#: prompt: see tests/hybrid_algos/train/test_learning.py for why. Real models want OpenRLHF-scale settings (lr ~1e-6),
#: which are the defaults.
DEMO_SETTINGS: dict[str, Any] = dict(
    task="copy",
    task_length=1,
    max_steps=32,
    rollout_batch_size=16,
    n_samples_per_prompt=16,
    train_batch_size=64,
    micro_train_batch_size=32,
    micro_rollout_batch_size=64,
    max_epochs=2,
    actor_learning_rate=2e-3,
    critic_learning_rate=2e-3,
    adam_betas=(0.9, 0.999),
    use_kl_loss=True,
    kl_estimator="k3",
    init_kl_coef=1e-3,
    lr_scheduler="cosine_with_min_lr",
    min_lr_ratio=0.1,
)
