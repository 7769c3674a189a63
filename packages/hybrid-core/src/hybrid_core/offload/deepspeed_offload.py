"""DeepSpeed's own ``offload_states`` / ``reload_states`` (ZeRO-1/2/3) behind the :class:`Sleepable` interface.

DeepSpeed only moves the states of its own optimizer (the one declared in the DeepSpeed config, FusedAdam on GPU),
so an engine built with a client optimizer is refused up front. The byte count is that of the device tensors
DeepSpeed copies (fp32 master partitions, 16-bit params, gradient partitions, Adam moments), taken before the move;
buffers it merely drops (ZeRO-3's contiguous gradient bucket) are freed but not counted as moved.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import torch

from ..errors import ConfigError
from ..stats import TransferStats
from .host_buffers import resolve_pin_memory

# ZeRO optimizer attributes holding the device state that offload_states moves (stage 3, then stages 1/2).
_STATE_ATTRS = ("fp32_partitioned_groups_flat", "lp_param_buffer", "grad_partitions_flat_buffer",
                "single_partition_of_fp32_groups", "bit16_groups_flat", "averaged_gradients")


class DeepSpeedOffloader:
    """``sleep()`` = ``engine.offload_states()``, ``wake()`` = ``engine.reload_states()``, both timed.

    ``pin_memory``: ``None`` pins when the torch build can. ``include``: DeepSpeed ``OffloadStateTypeEnum`` values
    to move (default: all of them).
    """

    def __init__(self, engine: Any, *, pin_memory: bool | None = None, include: Iterable[Any] | None = None):
        stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
        if stage not in (1, 2, 3) or not hasattr(engine, "offload_states"):
            raise ConfigError("zero_stage", f"DeepSpeed can only offload/reload states with ZeRO 1-3 (got {stage}).",
                              "Use zero_optimization.stage 1, 2 or 3, or StateOffloader for a plain torch role.")
        if getattr(engine, "client_optimizer", None) is not None:
            raise ConfigError("optimizer", "DeepSpeed's offload_states only moves its own optimizer's states, but the "
                              "engine was given a client optimizer.",
                              'Declare the optimizer in the DeepSpeed config ({"optimizer": {"type": "AdamW", ...}}).')
        self.engine = engine
        self.pin_memory = resolve_pin_memory(pin_memory)
        self.include = list(include) if include is not None else None
        self._asleep = False
        self._bytes = 0

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
        self.engine.offload_states(include=self.include, device=OffloadDeviceEnum.cpu, pin_memory=self.pin_memory,
                                   non_blocking=False)
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
        return TransferStats(self._bytes, time.perf_counter() - start, "deepspeed wake")


def _state_bytes(zero_optimizer: Any) -> int:
    """Bytes of the distinct storages DeepSpeed's offload moves (so aliases are counted once)."""
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

    for name in _STATE_ATTRS:  # ZeRO-3's contiguous gradient bucket is dropped, not copied: not counted
        collect(getattr(zero_optimizer, name, None))
    inner = getattr(zero_optimizer, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        collect({k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0})
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel() > 0}
    return sum(storages.values())


def _sync(engine: Any) -> None:
    if torch.cuda.is_available() and getattr(engine, "device", torch.device("cpu")).type == "cuda":
        torch.cuda.synchronize(engine.device)
