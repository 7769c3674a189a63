"""The one place a trained role's backend is chosen: ``trainer.backend`` -> its engine and its offloader.

A backend is an engine satisfying :class:`~.engine.TrainingEngine` and an offloader with the residency owner's
``offload(states)`` / ``reload(states)`` contract; adding one touches its own modules and an entry here.
``deepspeed``: DeepSpeed's ZeRO engine (:mod:`.deepspeed_engine`), :class:`~hybrid_core.offload.DeepSpeedOffloader`.
``fsdp2``: torch's ``fully_shard`` (:mod:`.fsdp2_engine`) with AdamW on the shards and DeepSpeed's learning-rate
schedule (:mod:`.lr_schedule`), :class:`~hybrid_core.offload.fsdp2_offload.FSDP2Offloader`.
"""

from __future__ import annotations

from typing import Any

import torch

from hybrid_core.errors import ConfigError
from hybrid_core.offload import StateMover

from ..workers.settings import DEEPSPEED_ONLY, TrainerSettings
from .engine import TrainingEngine


def model_dtype(trainer: TrainerSettings) -> torch.dtype:
    """The dtype to load a trained role's model in: DeepSpeed's model dtype, or FSDP2's master dtype (the sharded
    parameters, their gradients and Adam's moments; the forward computes in bf16 with ``trainer.bf16`` either way)."""
    if trainer.backend == "fsdp2":
        return torch.bfloat16 if trainer.bf16_master_weights else torch.float32
    return torch.bfloat16 if trainer.bf16 else torch.float32


def activation_checkpointing_by_loader(trainer: TrainerSettings) -> bool:
    """Whether the model loader turns on gradient checkpointing (DeepSpeed), or the FSDP2 set-up does it before
    sharding (so that FSDP2 wraps the checkpointed layers)."""
    return trainer.gradient_checkpointing and trainer.backend == "deepspeed"


def make_training_engine(
    trainer: TrainerSettings, model: torch.nn.Module, lr: float, shape: dict[str, int], device: torch.device
) -> TrainingEngine:
    """The engine of a trained role over ``model`` with learning rate ``lr``; ``shape``: the update shape
    (:func:`~hybrid_algos.train.workers.policy.update_shape`: micro_batch, grad_accum, total_updates)."""
    if trainer.backend == "deepspeed":
        from .deepspeed_engine import DeepSpeedTrainingEngine

        return DeepSpeedTrainingEngine.build(trainer, model, lr, **shape)
    if trainer.backend == "fsdp2":
        return _fsdp2_engine(trainer, model, lr, shape, device)
    raise ConfigError("trainer.backend", f"no trainer backend {trainer.backend!r}.", "Use deepspeed or fsdp2.")


def _fsdp2_engine(
    trainer: TrainerSettings, model: torch.nn.Module, lr: float, shape: dict[str, int], device: torch.device
) -> TrainingEngine:
    from .fsdp2_engine import FSDP2Engine
    from .fsdp2_setup import FSDP2Options
    from .lr_schedule import lr_multiplier, lr_schedule

    for name, default in DEEPSPEED_ONLY.items():  # e.g. the planner's CPU Adam: FSDP2 has none, so say so
        if getattr(trainer, name) != default:
            raise ConfigError(
                f"trainer.{name}",
                f"is DeepSpeed's ({getattr(trainer, name)!r} here); trainer.backend fsdp2 cannot honour it.",
                "Keeping the optimizer in host memory is DeepSpeed's CPU Adam: use trainer.backend deepspeed, or "
                "leave the GPUs more room (fewer roles per GPU, smaller micro-batches).",
            )
    compute = torch.bfloat16 if trainer.bf16 else torch.float32
    options = FSDP2Options(
        master_dtype=model_dtype(trainer),
        compute_dtype=compute,
        reduce_dtype=torch.float32,
        activation_checkpointing=trainer.gradient_checkpointing,
    )
    return FSDP2Engine.build(
        model,
        options,
        device,
        lr=lr,
        betas=(*trainer.adam_betas,),
        weight_decay=trainer.weight_decay,
        max_norm=trainer.max_grad_norm,
        lr_lambda=lr_multiplier(**lr_schedule(trainer, shape["total_updates"])),
        weights_dtype=compute,  # what the engines and HF export get: the model dtype, as under DeepSpeed
    )


def make_offloader(trainer: TrainerSettings, engine: Any) -> StateMover:
    """The offloader that moves ``engine``'s states (params, grads, optimizer) for the residency owner."""
    if trainer.backend == "fsdp2":
        from hybrid_core.offload.fsdp2_offload import FSDP2Offloader

        return FSDP2Offloader(engine.module, engine.optimizer)
    from hybrid_core.offload import DeepSpeedOffloader

    return DeepSpeedOffloader(engine.deepspeed)
