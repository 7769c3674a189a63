"""The one place a role's backend is chosen: ``trainer.backend`` -> a trained role's engine and its offloader, and
whether and how a frozen role (reference, reward model) is sharded.

A backend is an engine satisfying :class:`~.engine.TrainingEngine`, an offloader with the residency owner's
``offload(states)`` / ``reload(states)`` contract, and a way to shard a frozen model with its offloader; adding one
touches its own modules and an entry here.
``deepspeed``: DeepSpeed's ZeRO engine (:mod:`.deepspeed_engine`), :class:`~hybrid_core.offload.DeepSpeedOffloader`;
frozen models under ZeRO-3 as DeepSpeed inference engines (:mod:`..workers.zero3_frozen`).
``fsdp2``: torch's ``fully_shard`` (:mod:`.fsdp2_engine`) with AdamW on the shards and DeepSpeed's learning-rate
schedule (:mod:`.lr_schedule`), :class:`~hybrid_core.offload.fsdp2_offload.FSDP2Offloader`; frozen models sharded
by ``fully_shard`` too (:mod:`.fsdp2_frozen`), sleeping through the same offloader.
"""

from __future__ import annotations

from typing import Any

import torch

from hybrid_core.errors import ConfigError
from hybrid_core.offload import StateMover
from hybrid_core.residency.memory import frozen_shards

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


def frozen_sharded(trainer: TrainerSettings, ranks: int) -> bool:
    """Whether a frozen role of ``ranks`` workers shards its parameters over them: the memory model's rule
    (:func:`~hybrid_core.residency.memory.frozen_shards`), so the plan counts 1/N exactly when the worker holds it."""
    return frozen_shards(trainer.zero_stage, ranks=ranks, backend=trainer.backend) > 1


def shard_frozen(
    trainer: TrainerSettings, model: torch.nn.Module, device: torch.device, *, micro_batch: int
) -> tuple[Any, StateMover]:
    """A frozen role's ``model`` (loaded on the host) sharded over the ranks of the default group by the trainers'
    backend, to call for its forwards, and the offloader the residency owner moves its shards with (``params``).
    ``micro_batch``: the role's forward micro-batch (DeepSpeed's config wants one)."""
    if trainer.backend == "fsdp2":
        from hybrid_core.offload.fsdp2_offload import FSDP2Offloader

        from .fsdp2_frozen import shard_frozen as fully_shard_frozen

        module = fully_shard_frozen(model, device)
        return module, FSDP2Offloader(module, None, device=device)
    if trainer.backend == "deepspeed":
        from ..workers.zero3_frozen import ShardOffloader, frozen_deepspeed_config, sharded_engine

        engine = sharded_engine(model, frozen_deepspeed_config(trainer, micro_batch=micro_batch))
        return engine, ShardOffloader(engine.module, device)
    raise ConfigError("trainer.backend", f"no trainer backend {trainer.backend!r}.", "Use deepspeed or fsdp2.")
