"""The FSDP2 backend's learning-rate schedule gives, update for update, the rates DeepSpeed's own scheduler gives
for the same settings: the config deepspeed_config writes, run through DeepSpeed's WarmupLR / WarmupCosineLR
classes stepped as its engine steps them (after each update)."""

from __future__ import annotations

import pytest
import torch

from hybrid_algos.train.deepspeed_setup import deepspeed_config
from hybrid_algos.train.trainer_backends.lr_schedule import lr_multiplier, lr_schedule
from hybrid_algos.train.workers.settings import TrainerSettings

LR, UPDATES = 1e-3, 12


def deepspeed_rates(trainer: TrainerSettings) -> list[float]:
    """The rate of each update under DeepSpeed's scheduler (none in the config: the optimizer's own)."""
    from deepspeed.runtime import lr_schedules

    config = deepspeed_config(
        zero_stage=2,
        bf16=False,
        micro_batch=1,
        grad_accum=1,
        lr=LR,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        max_norm=1.0,
        adam_offload=False,
        **lr_schedule(trainer, UPDATES),
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = config.get("scheduler")
    sched = getattr(lr_schedules, scheduler["type"])(opt, **scheduler["params"]) if scheduler else None
    rates = []
    for _ in range(UPDATES):
        rates.append(opt.param_groups[0]["lr"])  # the rate this update steps with
        if sched is not None:
            opt.step()
            sched.step()
    return rates


def our_rates(trainer: TrainerSettings) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(**lr_schedule(trainer, UPDATES)))
    rates = []
    for _ in range(UPDATES):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()  # (no gradients: nothing moves) torch wants the update before the schedule's step
        sched.step()
    return rates


@pytest.mark.parametrize(
    "trainer",
    [
        TrainerSettings(),  # no scheduler
        TrainerSettings(lr_warmup_ratio=0.25),  # WarmupLR over 3 updates
        TrainerSettings(lr_warmup_ratio=0.1),  # 1 update asked: DeepSpeed warms up over 2
        TrainerSettings(lr_scheduler="cosine_with_min_lr"),  # no warm-up: starts at the full rate
        TrainerSettings(lr_scheduler="cosine_with_min_lr", lr_warmup_ratio=0.25, min_lr_ratio=0.2),
    ],
    ids=["constant", "warmup", "short_warmup", "cosine", "cosine_warmup"],
)
def test_the_rates_match_deepspeed_update_for_update(trainer: TrainerSettings) -> None:
    expected = deepspeed_rates(trainer)
    assert our_rates(trainer) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert len(set(expected)) > 1 or trainer == TrainerSettings()  # each case really schedules something
