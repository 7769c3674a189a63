"""The trainer section (hybrid_algos.train.workers.settings): its checks name ``trainer.<field>``, the training config
turns them into the flags the user wrote, the flat names map onto its fields, and the workers' DeepSpeed configs and
micro-batches are made from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_algos.train import sections
from hybrid_algos.train.config import GRPOConfig, PPOConfig
from hybrid_algos.train.trainer_backends.deepspeed_engine import trainer_config
from hybrid_algos.train.workers.policy import update_shape
from hybrid_algos.train.workers.settings import DEFAULT_MAX_TOKENS_PER_GPU, TrainerSettings
from hybrid_algos.train.workers.zero3_frozen import frozen_deepspeed_config
from hybrid_core.errors import ConfigError

#: (section field changes, the field the error names, the flat setting that sets it, text the error holds)
BAD = [
    ({"zero_stage": 4}, "zero_stage", "zero_stage", "must be 0, 1, 2 or 3"),
    ({"bf16_master_weights": True}, "bf16_master_weights", "bf16_master_weights", "trains in fp32"),
    ({"bf16": True, "zero_stage": 0, "bf16_optimizer_states": True}, "bf16_optimizer_states", None, "ZeRO optimizer"),
    ({"bf16": True, "bf16_optimizer_states": True}, "bf16_optimizer_states", None, "master weights in bf16 too"),
    ({"bf16": True, "bf16_master_weights": True}, "bf16_master_weights", None, "host memory"),
    ({"actor_lr": 0.0}, "actor_lr", "actor_learning_rate", "must be > 0"),
    ({"critic_lr": -1.0}, "critic_lr", "critic_learning_rate", "must be > 0"),
    ({"lr_scheduler": "linear"}, "lr_scheduler", "lr_scheduler", "is not one of"),
    ({"lr_warmup_ratio": 1.5}, "lr_warmup_ratio", "lr_warmup_ratio", "[0, 1]"),
    ({"min_lr_ratio": True}, "min_lr_ratio", "min_lr_ratio", "[0, 1]"),
    ({"train_max_tokens": 0}, "train_max_tokens", "train_max_tokens_per_gpu", "positive integer"),
    ({"rollout_max_tokens": 1.5}, "rollout_max_tokens", "rollout_max_tokens_per_gpu", "positive integer"),
]


@pytest.mark.parametrize("changes, field, flat, text", BAD)
def test_the_section_refuses_each_bad_value_by_its_section_name(changes, field, flat, text):
    with pytest.raises(ConfigError) as e:
        TrainerSettings(**changes).validate()
    assert e.value.field == f"trainer.{field}" and text in str(e.value)
    assert "--" not in str(e.value)  # the trainer's section spells no command-line flag


@pytest.mark.parametrize("changes, field, flat, text", BAD)
def test_through_the_config_the_same_error_names_the_flag(changes, field, flat, text):
    flat_of = sections.fields_of("trainer")
    settings = {flat_of[k]: v for k, v in changes.items()}
    with pytest.raises(ConfigError) as e:
        PPOConfig(**settings).validate()
    assert e.value.field == (flat or field) and text in str(e.value) and "trainer." not in str(e.value)
    with pytest.raises(ConfigError) as raw:
        TrainerSettings(**changes).validate()
    assert str(e.value) == str(sections.in_flag_words(raw.value))


def test_the_precision_errors_read_as_before():
    with pytest.raises(ConfigError) as e:
        GRPOConfig(bf16_master_weights=True).validate()
    assert str(e.value) == (
        "bf16_master_weights: bf16 master weights and optimizer states are for a model trained in bf16, and this one "
        "trains in fp32 (no --bf16). Fix: Add --bf16, or drop --bf16_master_weights."
    )


def test_the_table_maps_every_field_and_the_config_builds_the_section():
    assert not [p for p in sections.table_problems() if "trainer." in p]
    assert set(sections.fields_of("trainer")) == {f.name for f in dataclasses.fields(TrainerSettings)}
    trainer = PPOConfig(l2=0.1, max_norm=0.5, use_dynamic_batch=True, packing_samples=True).trainer_settings()
    assert (trainer.weight_decay, trainer.max_grad_norm, trainer.dynamic_batch, trainer.packing) == (
        0.1,
        0.5,
        True,
        True,
    )
    defaults = TrainerSettings()
    for field, flat in sections.fields_of("trainer").items():
        assert getattr(defaults, field) == getattr(PPOConfig, flat), field  # the section's defaults are the config's


def test_token_budgets_and_state_moves():
    assert TrainerSettings().train_token_budget == DEFAULT_MAX_TOKENS_PER_GPU
    assert TrainerSettings(train_max_tokens=4096).rollout_token_budget == 4096  # the forward passes' follow
    assert TrainerSettings(train_max_tokens=4096, rollout_max_tokens=8192).rollout_token_budget == 8192
    assert TrainerSettings(zero_stage=1).moves_states and not TrainerSettings(zero_stage=0).moves_states


def test_the_deepspeed_configs_come_from_the_section():
    cfg = GRPOConfig(
        zero_stage=3,
        bf16=True,
        adam_offload=True,
        l2=0.05,
        max_norm=0.7,
        adam_betas=[0.9, 0.99],  # a --config file's list
        lr_scheduler="cosine_with_min_lr",
        lr_warmup_ratio=0.25,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        train_batch_size=8,
        micro_train_batch_size=2,
        max_epochs=2,
    )
    trainer = cfg.trainer_settings()
    model = torch.nn.Linear(4, 4)
    shape = update_shape(cfg.rollout_settings(), world_size=2, total_steps=10)
    assert shape == {"micro_batch": 2, "grad_accum": 2, "total_updates": 10 * 2 * 2}
    ds = trainer_config(trainer, model, trainer.critic_lr, **shape)
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["optimizer"]["params"] == {"lr": trainer.critic_lr, "betas": [0.9, 0.99], "weight_decay": 0.05}
    assert ds["gradient_clipping"] == 0.7 and ds["bf16"]["enabled"]
    assert ds["scheduler"]["type"] == "WarmupCosineLR" and ds["scheduler"]["params"]["warmup_num_steps"] == 10
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (2, 2)
    frozen = frozen_deepspeed_config(trainer, micro_batch=3)
    assert frozen["bf16"]["enabled"] and frozen["train_micro_batch_size_per_gpu"] == 3
