"""The learning-rate schedule of a non-DeepSpeed trained role, update for update the one DeepSpeed runs.

:func:`~hybrid_algos.train.deepspeed_setup.deepspeed_config` turns ``lr_warmup_ratio`` / ``lr_scheduler`` into
DeepSpeed's ``WarmupLR`` or ``WarmupCosineLR`` (or no scheduler). Switching the trainer backend must not change the
rates a run trains with, so :func:`lr_multiplier` reproduces DeepSpeed 0.19's arithmetic for the same arguments,
quirks included: the warm-up spans at least 2 updates, and with ``last_batch_iteration = -1`` the first update runs
at the warm-up's start (0), because DeepSpeed steps the schedule only after each update. The result is the
multiple of the role's learning rate for each update count, as ``torch.optim.lr_scheduler.LambdaLR`` takes it
(tests/hybrid_algos/train/test_lr_schedule.py compares it with DeepSpeed's own classes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..workers.settings import TrainerSettings


def lr_schedule(trainer: TrainerSettings, total_updates: int) -> dict[str, Any]:
    """The learning-rate schedule's arguments of :func:`~hybrid_algos.train.deepspeed_setup.deepspeed_config` and
    :func:`lr_multiplier`, counted in optimizer updates: linear warm-up over ``lr_warmup_ratio`` of the run's
    updates, then constant or a cosine decay to ``min_lr_ratio``."""
    return {
        "warmup_steps": int(trainer.lr_warmup_ratio * total_updates),
        "lr_scheduler": trainer.lr_scheduler,
        "total_updates": total_updates,
        "min_lr_ratio": trainer.min_lr_ratio,
    }


def lr_multiplier(
    *, warmup_steps: int, lr_scheduler: str, total_updates: int, min_lr_ratio: float
) -> Callable[[int], float]:
    """``updates -> lr multiple`` for the arguments :func:`lr_schedule` gives."""
    if lr_scheduler == "cosine_with_min_lr" and total_updates > 0:
        warmup = max(2, int(warmup_steps))
        # without a warm-up DeepSpeed starts the schedule at iteration 0 with a floor of 1 (the full rate)
        start, floor = (-1, 0.0) if warmup_steps > 0 else (0, 1.0)
        return lambda updates: _cosine(start + updates, warmup, floor, total_updates, min_lr_ratio)
    if warmup_steps > 0:
        warmup = max(2, int(warmup_steps))
        return lambda updates: _linear_warmup(updates - 1, warmup)
    return lambda _updates: 1.0


def _linear_warmup(iteration: int, warmup: int) -> float:
    """``WarmupLR`` (linear, from 0 to the rate) after ``iteration + 1`` scheduler steps."""
    if iteration < 0:
        return 0.0
    return iteration / warmup if iteration < warmup else 1.0


def _cosine(iteration: int, warmup: int, floor: float, total: int, min_ratio: float) -> float:
    """``WarmupCosineLR.get_lr_ratio`` (linear warm-up from ``floor``, cosine decay to ``min_ratio``)."""
    if iteration < 0:
        return 0.0
    if iteration < warmup:
        return floor + iteration / warmup * (1.0 - floor)
    progress = min(1.0, (iteration - warmup + 1) / max(1, total - warmup))
    return max(0.0, min_ratio + (1.0 - min_ratio) * (1 + math.cos(math.pi * progress)) / 2)
