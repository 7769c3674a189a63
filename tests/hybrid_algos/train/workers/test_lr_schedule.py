"""--lr_scheduler / --min_lr_ratio: the schedule DeepSpeed is given, run through DeepSpeed's own scheduler class, and
bad values refused before anything starts."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybrid_algos.train import GRPOConfig
from hybrid_algos.train.deepspeed_setup import deepspeed_config
from hybrid_algos.train.trainer_backends.lr_schedule import lr_schedule
from hybrid_algos.train.workers.policy import update_shape
from hybrid_core.errors import ConfigError


def _rates(config: dict, updates: int) -> list[float]:
    """The learning rate of each optimizer update under the scheduler DeepSpeed builds from ``config``."""
    from deepspeed.runtime import lr_schedules

    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW(params, lr=config["optimizer"]["params"]["lr"])
    scheduler = getattr(lr_schedules, config["scheduler"]["type"])(opt, **config["scheduler"]["params"])
    rates = []
    for _ in range(updates):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates


def _schedule(cfg: GRPOConfig, total_steps: int) -> dict:
    """The schedule a trained role is given for a run of ``total_steps`` steps (its updates: the rollout's shape)."""
    return lr_schedule(cfg.trainer_settings(), update_shape(cfg.rollout_settings(), 1, total_steps)["total_updates"])


def _config(cfg: GRPOConfig, total_steps: int) -> dict:
    return deepspeed_config(
        zero_stage=1,
        bf16=False,
        micro_batch=4,
        grad_accum=1,
        lr=cfg.actor_learning_rate,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        max_norm=1.0,
        adam_offload=False,
        **_schedule(cfg, total_steps),
    )


def test_cosine_decays_from_the_rate_to_its_floor_over_the_run() -> None:
    cfg = GRPOConfig(
        actor_learning_rate=1e-3,
        lr_scheduler="cosine_with_min_lr",
        min_lr_ratio=0.1,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        train_batch_size=8,
        max_epochs=2,
    )
    schedule = _schedule(cfg, total_steps=10)
    assert schedule["total_updates"] == 10 * 2 * 2  # 16 samples per step / 8 per update, 2 epochs
    rates = _rates(_config(cfg, 10), schedule["total_updates"])
    assert rates[0] == pytest.approx(1e-3)  # no warm-up asked: the first update at the full rate
    assert all(a >= b for a, b in itertools.pairwise(rates))  # never rises
    assert rates[-1] == pytest.approx(1e-4, rel=0.05)  # the last update at min_lr_ratio * lr


def test_cosine_after_a_linear_warm_up() -> None:
    cfg = GRPOConfig(
        actor_learning_rate=1e-3,
        lr_scheduler="cosine_with_min_lr",
        min_lr_ratio=0.0,
        lr_warmup_ratio=0.25,
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        train_batch_size=8,
    )
    schedule = _schedule(cfg, total_steps=16)
    assert schedule["warmup_steps"] == 4
    rates = _rates(_config(cfg, 16), schedule["total_updates"])
    # DeepSpeed's warm-up (as its WarmupLR's) starts from 0 one update late: 0, 0, 1/4, 2/4, 3/4, then the decay
    assert rates[:2] == [0, 0] and rates[2] < rates[3] < rates[4] < rates[5] == pytest.approx(1e-3, rel=0.05)
    assert max(rates) == rates[5]
    assert rates[-1] < 0.05e-3


def test_constant_keeps_the_rate_and_warm_up_alone_still_warms() -> None:
    cfg = GRPOConfig(actor_learning_rate=1e-3, rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8)
    assert "scheduler" not in _config(cfg, 16)  # constant, no warm-up: DeepSpeed keeps the optimizer's rate
    warm = GRPOConfig(
        actor_learning_rate=1e-3, lr_warmup_ratio=0.5, rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8
    )
    rates = _rates(_config(warm, 16), 16)
    assert rates[0] == 0 and all(a <= b for a, b in itertools.pairwise(rates))
    assert rates[9:] == [pytest.approx(1e-3)] * 7


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("lr_scheduler", "linear", "lr_scheduler"),
        ("min_lr_ratio", 1.5, "[0, 1]"),
        ("lr_warmup_ratio", -0.1, "[0, 1]"),
    ],
)
def test_bad_schedules_are_refused(field: str, value, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        GRPOConfig(**{field: value}).validate()
    assert field in str(info.value) and fragment in str(info.value)
