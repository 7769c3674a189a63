"""What a trained role (actor, critic) needs of its trainer backend: forward, backward over micro-batches, the
update at the accumulation boundary, the update's gradient norm and learning rate, checkpoints and full weights.

It is the part of DeepSpeed's engine that ``workers/policy.py`` and ``workers/critic.py`` use, so that a thin
DeepSpeed adapter (:mod:`.deepspeed_engine`) satisfies it as well as
:class:`~hybrid_algos.train.trainer_backends.fsdp2_engine.FSDP2Engine`; :mod:`.registry` makes either.
The caller scales each micro-batch's loss by its share of the update (DeepSpeed's ``scale_wrt_gas=False``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class TrainingEngine(Protocol):
    #: the model (forward through it, or through the engine; ``models._unwrap`` finds it here)
    module: torch.nn.Module

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Whether the next ``step()`` ends the update (the workers say so for every micro-batch)."""

    def is_gradient_accumulation_boundary(self) -> bool: ...

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate ``loss``'s gradients (already scaled by the caller)."""

    def step(self) -> None:
        """At the boundary: clip, apply the update, clear the gradients, advance the schedule; otherwise nothing."""

    def get_global_grad_norm(self) -> float | None:
        """The last update's gradient norm over all ranks, before clipping (None before the first)."""

    def get_lr(self) -> list[float]: ...

    def save_checkpoint(self, path: str, tag: str) -> None: ...

    def load_checkpoint(self, path: str, tag: str) -> None:
        """Raises FileNotFoundError when ``path/tag`` holds no complete checkpoint."""

    def full_weights(self, bucket_bytes: int, *, merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, full (gathered), by name; collective: every rank iterates together. A PEFT model's
        come merged under the base names, or (``merged`` False) as its own parameters, adapters apart."""

    def weight_metas(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, full shape)`` of what :meth:`full_weights` hands out, without gathering anything."""

    def num_params(self) -> int:
        """The model's parameters, all ranks' shards together."""
