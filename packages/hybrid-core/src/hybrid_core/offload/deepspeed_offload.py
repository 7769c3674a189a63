"""DeepSpeed's own ``offload_states`` / ``reload_states`` (ZeRO-1/2/3) behind the :class:`Sleepable` interface,
and state by state (``offload(["optimizer"])``) for the residency planner: parameters, gradients and the optimizer
(fp32 master weights + Adam moments) can leave the GPU separately.

DeepSpeed only moves the states of its own optimizer (the one declared in the DeepSpeed config, FusedAdam on GPU),
so an engine built with a client optimizer is refused up front. The byte count is that of the device tensors
DeepSpeed copies (fp32 master partitions, 16-bit params, gradient partitions, Adam moments), taken before the move;
buffers it merely drops (ZeRO-3's contiguous gradient bucket) are freed but not counted as moved.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import ConfigError
from ..stats import TransferStats
from .host_buffers import resolve_pin_memory

# ZeRO optimizer attributes holding the device state that offload_states moves (stage 3, then stages 1/2).
_STATE_ATTRS = (
    "fp32_partitioned_groups_flat",
    "lp_param_buffer",
    "grad_partitions_flat_buffer",
    "single_partition_of_fp32_groups",
    "bit16_groups_flat",
    "averaged_gradients",
)
#: Our state names -> DeepSpeed's OffloadStateTypeEnum values, and the attributes holding each (for byte counts).
STATE_TYPES = {
    "params": ("lp_params",),
    "grads": ("lp_grads", "contiguous_grad_buffer"),
    "optimizer": ("optim_states", "hp_params"),
}
_ATTRS_OF = {
    "params": ("lp_param_buffer", "bit16_groups_flat"),
    "grads": ("grad_partitions_flat_buffer", "averaged_gradients"),
    "optimizer": ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"),
}


class DeepSpeedOffloader:
    """``sleep()`` = ``engine.offload_states()``, ``wake()`` = ``engine.reload_states()``, both timed.

    ``pin_memory``: ``None`` pins when the torch build can. ``include``: DeepSpeed ``OffloadStateTypeEnum`` values
    to move (default: all of them).
    """

    def __init__(self, engine: Any, *, pin_memory: bool | None = None, include: Iterable[Any] | None = None):
        stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
        if stage not in (1, 2, 3) or not hasattr(engine, "offload_states"):
            raise ConfigError(
                "zero_stage",
                f"DeepSpeed can only offload/reload states with ZeRO 1-3 (got {stage}).",
                "Use zero_optimization.stage 1, 2 or 3, or StateOffloader for a plain torch role.",
            )
        if getattr(engine, "client_optimizer", None) is not None:
            raise ConfigError(
                "optimizer",
                "DeepSpeed's offload_states only moves its own optimizer's states, but the "
                "engine was given a client optimizer.",
                'Declare the optimizer in the DeepSpeed config ({"optimizer": {"type": "AdamW", ...}}).',
            )
        self.engine = engine
        self.pin_memory = resolve_pin_memory(pin_memory)
        self.include = list(include) if include is not None else None
        self._asleep = False
        self._bytes = 0
        self._away: dict[str, int] = {}  # state -> bytes moved by offload()

    @property
    def asleep(self) -> bool:
        return self._asleep

    def device_bytes(self) -> int:
        """Bytes of device state DeepSpeed would move now (0 while asleep)."""
        return 0 if self._asleep else _state_bytes(self.engine.optimizer)

    def sleep(self) -> TransferStats:
        if self._asleep:
            return TransferStats(0, 0.0, "deepspeed sleep")
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

        self._bytes = _state_bytes(self.engine.optimizer)
        _sync(self.engine)
        start = time.perf_counter()
        self.engine.offload_states(
            include=self.include, device=OffloadDeviceEnum.cpu, pin_memory=self.pin_memory, non_blocking=False
        )
        _sync(self.engine)
        self._asleep = True
        return TransferStats(self._bytes, time.perf_counter() - start, "deepspeed sleep")

    def wake(self) -> TransferStats:
        if not self._asleep:
            return TransferStats(0, 0.0, "deepspeed wake")
        start = time.perf_counter()
        self.engine.reload_states(non_blocking=False)
        _sync(self.engine)
        self._asleep = False
        self._away = {}
        return TransferStats(self._bytes, time.perf_counter() - start, "deepspeed wake")

    # ---- state by state (residency) --------------------------------------------------------------------------------
    def offload(self, states: Sequence[str]) -> TransferStats:
        """Move ``states`` (any of "params", "grads", "optimizer") to host memory; the others stay on the GPU."""
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        unknown = [s for s in states if s not in STATE_TYPES]
        if unknown:
            raise ConfigError("states", f"DeepSpeed roles hold {', '.join(STATE_TYPES)}, not {unknown}.")
        todo = [s for s in states if s not in self._away]
        if not todo:
            return TransferStats(0, 0.0, "deepspeed offload")
        include = [OffloadStateTypeEnum(t) for s in todo for t in STATE_TYPES[s]]
        moved = {s: _state_bytes(self.engine.optimizer, only=s) for s in todo}
        _sync(self.engine)
        start = time.perf_counter()
        self.engine.offload_states(
            include=include, device=OffloadDeviceEnum.cpu, pin_memory=self.pin_memory, non_blocking=False
        )
        _sync(self.engine)
        self._away.update(moved)
        self._asleep = True
        return TransferStats(sum(moved.values()), time.perf_counter() - start, "deepspeed offload " + "+".join(todo))

    def reload(self, states: Sequence[str] | None = None) -> TransferStats:
        """Bring back what :meth:`offload` moved (DeepSpeed reloads every offloaded state at once)."""
        if not self._away:
            return TransferStats(0, 0.0, "deepspeed reload")
        start = time.perf_counter()
        self.engine.reload_states(non_blocking=False)
        _sync(self.engine)
        moved, self._away, self._asleep = sum(self._away.values()), {}, False
        return TransferStats(moved, time.perf_counter() - start, "deepspeed reload")

    @property
    def offloaded(self) -> tuple[str, ...]:
        return tuple(self._away)


def _state_bytes(zero_optimizer: Any, only: str | None = None) -> int:
    """Bytes of the distinct storages DeepSpeed's offload moves (so aliases are counted once); ``only``: those of
    one state ("params", "grads" or "optimizer")."""
    tensors: list[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)

    names = _ATTRS_OF[only] if only else _STATE_ATTRS
    for name in names:  # ZeRO-3's contiguous gradient bucket is dropped, not copied: not counted
        collect(getattr(zero_optimizer, name, None))
    if only in (None, "optimizer"):
        inner = getattr(zero_optimizer, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            collect({k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0})
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel() > 0}
    return sum(storages.values())


def _sync(engine: Any) -> None:
    if torch.cuda.is_available() and getattr(engine, "device", torch.device("cpu")).type == "cuda":
        torch.cuda.synchronize(engine.device)
