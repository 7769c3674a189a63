"""The DeepSpeed trainer backend behind :class:`~.engine.TrainingEngine`: a thin adapter over DeepSpeed's engine.

The workers scale each micro-batch's loss by its share of the update themselves, so ``backward`` is DeepSpeed's with
``scale_wrt_gas=False``; full weights are ZeRO-3's gathered groups (or the parameters as they are under ZeRO 0-2);
checkpoints are DeepSpeed's own, without the ``latest`` file (the run folder names the tag). A PEFT model's full
weights come out merged, under the base model's names (:mod:`.peft_weights`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..deepspeed_setup import deepspeed_config, make_engine
from ..workers.settings import TrainerSettings
from .lr_schedule import lr_schedule
from .peft_weights import peft_export


class DeepSpeedTrainingEngine:
    """``engine``: what ``deepspeed.initialize`` returned (its offloader, DeepSpeedOffloader, takes it as it is)."""

    def __init__(self, engine: Any):
        self.deepspeed = engine
        self.module: torch.nn.Module = engine.module

    @classmethod
    def build(
        cls, trainer: TrainerSettings, model: torch.nn.Module, lr: float, **shape: int
    ) -> DeepSpeedTrainingEngine:
        return cls(make_engine(model, trainer_config(trainer, model, lr, **shape)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.deepspeed(*args, **kwargs)

    def train(self, mode: bool = True) -> Any:
        return self.deepspeed.train(mode)

    def eval(self) -> Any:
        return self.deepspeed.eval()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.deepspeed.set_gradient_accumulation_boundary(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.deepspeed.is_gradient_accumulation_boundary()

    def backward(self, loss: torch.Tensor) -> None:
        self.deepspeed.backward(loss, scale_wrt_gas=False)

    def step(self) -> None:
        self.deepspeed.step()

    def get_global_grad_norm(self) -> float | None:
        norm = self.deepspeed.get_global_grad_norm()
        return None if norm is None else float(norm)

    def get_lr(self) -> list[float]:
        return self.deepspeed.get_lr()

    def save_checkpoint(self, path: str, tag: str) -> None:
        self.deepspeed.save_checkpoint(path, tag=tag, save_latest=False)

    def load_checkpoint(self, path: str, tag: str) -> None:
        load_path, _ = self.deepspeed.load_checkpoint(
            path, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {path}")

    def weight_metas(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, full shape) of every parameter, without gathering (ZeRO-3 keeps the full shape aside)."""
        metas = [
            (name, p.dtype, tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape))
            for name, p in self.module.named_parameters()
        ]
        plan = peft_export(self.module)
        return metas if plan is None else plan.names(metas)

    def num_params(self) -> int:
        return sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.module.parameters())

    def full_weights(self, bucket_bytes: int = 1 << 30, *, merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (gathered) weights; under ZeRO-3 every rank must iterate together.

        ZeRO-3 shards are gathered in groups of up to ``bucket_bytes`` (one all-gather per group instead of one per
        parameter); each tensor is valid until the next one is requested, which is how the senders consume them.
        A PEFT model's are merged (a base weight is held until its adapters follow: ZeRO-3 frees a parameter by
        pointing it at an empty tensor, so the gathered one held here stays valid).
        """
        plan = peft_export(self.module) if merged else None
        weights = self._gathered(bucket_bytes)
        return weights if plan is None else plan.merged(weights)

    def _gathered(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        named = list(self.module.named_parameters())
        if self.deepspeed.zero_optimization_stage() != 3:
            for name, p in named:
                yield name, p.data
            return
        import deepspeed

        group: list[tuple[str, torch.nn.Parameter]] = []
        size = 0
        for name, p in [*named, ("", None)]:
            full = p.ds_numel * p.element_size() if p is not None else 0
            if group and (p is None or size + full > bucket_bytes):
                with deepspeed.zero.GatheredParameters([q for _, q in group], modifier_rank=None):
                    for gname, q in group:
                        yield gname, q.data
                group, size = [], 0
            if p is not None:
                group.append((name, p))
                size += full


def trainer_config(
    trainer: TrainerSettings,
    model: torch.nn.Module,
    lr: float,
    *,
    micro_batch: int,
    grad_accum: int,
    total_updates: int,
) -> dict:
    """The DeepSpeed config of a trained role (actor, critic): the trainer section's ZeRO, precision and optimizer
    settings with the role's own learning rate, on the actor's schedule (lr_warmup_ratio, lr_scheduler), for
    the update shape :func:`~hybrid_algos.train.workers.policy.update_shape` gives."""
    return deepspeed_config(
        zero_stage=trainer.zero_stage,
        bf16=trainer.bf16,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        lr=lr,
        betas=(*trainer.adam_betas,),  # a tuple (a --config file gives a list)
        weight_decay=trainer.weight_decay,
        max_norm=trainer.max_grad_norm,
        num_params=sum(p.numel() for p in model.parameters()),
        adam_offload=trainer.adam_offload,
        bf16_master_weights=trainer.bf16_master_weights,
        bf16_optimizer_states=trainer.bf16_optimizer_states,
        **lr_schedule(trainer, total_updates),
    )
