"""The FSDP2 trainer backend: a sharded model, torch's AdamW over its shards, and DeepSpeed's train-step contract.

As with DeepSpeed, the workers call ``backward`` then ``step`` for every micro-batch and say which one ends the
update (``set_gradient_accumulation_boundary``); ``step`` does nothing before the boundary. FSDP2 reduce-scatters
each micro-batch's gradients into the sharded ones (the memory of ZeRO-2/3: no unsharded gradient is kept between
micro-batches). At the boundary: the global gradient norm (over all ranks), clipping to ``max_norm`` (0: none),
AdamW's step on the local shards, gradients freed, and the learning-rate schedule advanced by one update.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hybrid_core.errors import ConfigError

from .fsdp2_checkpoint import load_sharded, save_sharded
from .fsdp2_setup import FSDP2Options, device_mesh, shard_causal_lm
from .fsdp2_weights import full_weights
from .peft_weights import peft_export


class FSDP2Engine:
    """Satisfies :class:`~hybrid_algos.train.trainer_backends.engine.TrainingEngine`.

    ``model``: a module already sharded by :func:`~.fsdp2_setup.shard_causal_lm` (see :meth:`build`). ``lr_lambda``:
    the schedule, as the multiple of ``lr`` for each update count (``LambdaLR``); None keeps ``lr``.
    ``weights_dtype``: the dtype :meth:`full_weights` hands out (None: the master dtype).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        max_norm: float = 1.0,
        lr_lambda: Callable[[int], float] | None = None,
        weights_dtype: torch.dtype | None = None,
    ):
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            raise ConfigError(
                "model", "is not sharded by FSDP2.", "Build it with FSDP2Engine.build or shard_causal_lm."
            )
        if max_norm < 0:
            raise ConfigError("max_norm", f"must be >= 0 (0: no clipping), got {max_norm}.")
        self.module = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda or (lambda _update: 1.0))
        self.max_norm = max_norm
        self.weights_dtype = weights_dtype
        self.updates = 0
        self._boundary = True
        self._norm: torch.Tensor | None = None

    @classmethod
    def build(cls, model: torch.nn.Module, options: FSDP2Options, device: torch.device, **kwargs: Any) -> FSDP2Engine:
        """Shard ``model`` over every rank of the default group on ``device`` and make its engine.

        ``model`` may still be on the host: ``fully_shard`` moves each unit's parameters to the mesh's device as it
        shards them, so the whole model never sits on one GPU."""
        return cls(shard_causal_lm(model, device_mesh(device), options), **kwargs)

    # ---- forward ---------------------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> FSDP2Engine:
        self.module.train(mode)
        return self

    def eval(self) -> FSDP2Engine:
        return self.train(False)

    # ---- update ----------------------------------------------------------------------------------------------------
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary = bool(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._boundary

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        if not self._boundary:
            return
        self._norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.updates += 1

    def _clip(self) -> torch.Tensor:
        """The global gradient norm (a collective when the gradients are sharded); clips to ``max_norm`` if set."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            raise RuntimeError("step() at the accumulation boundary with no gradients: call backward() first")
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.max_norm, norm)
        return norm

    def get_global_grad_norm(self) -> float | None:
        return None if self._norm is None else float(self._norm)

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    # ---- checkpoints and weights -----------------------------------------------------------------------------------
    def save_checkpoint(self, path: str, tag: str) -> None:
        extra = {"scheduler": self.scheduler.state_dict(), "updates": self.updates}
        save_sharded(os.path.join(path, tag), self.module, self.optimizer, extra)

    def load_checkpoint(self, path: str, tag: str) -> None:
        extra = load_sharded(os.path.join(path, tag), self.module, self.optimizer)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.updates = int(extra["updates"])

    def full_weights(self, bucket_bytes: int = 1 << 30, *, merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return full_weights(self.module, bucket_bytes, self.weights_dtype, merged=merged)

    def weight_metas(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        # a DTensor's shape is the full one: no gather
        metas = [(n, self.weights_dtype or p.dtype, tuple(p.shape)) for n, p in self.module.named_parameters()]
        plan = peft_export(self.module)
        return metas if plan is None else plan.names(metas)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())  # DTensors count their full size
