"""Before state comes back onto a GPU, check the GPU has room for it (:func:`hybrid_core.gpu_memory.check_room`).

What a wake needs: what the same wake took last time (free memory before minus after, measured on its GPU), else
the bytes the plan's memory model gives the states being brought back. Who holds the rest comes from the
residency owner (the one place that knows what is on each GPU). Free memory is read by a worker on that GPU (a
control-thread call, answered even mid-phase); on a machine without CUDA the first probe says so and the guard turns
itself off.

The check cannot stop another process from taking the memory between the reading and the wake (seen on an H200: a
neighbour job grabbing what a sleep freed). So a wake that fails for want of memory is explained the same way, from a
fresh reading: :meth:`WakeGuard.explain_wake_failure`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..gpu_memory import GpuMemory, check_room, is_out_of_memory, room_error
from ..remote import get_with_timeout

log = logging.getLogger(__name__)


class WakeGuard:
    """``probes``: plan GPU -> (name, a worker handle with ``gpu_memory()``); ``holders(gpu)``: role -> bytes it
    holds there now (the owner's bookkeeping)."""

    def __init__(
        self,
        probes: Mapping[int, tuple[str, Any]],
        holders: Callable[[int], dict[str, int | None]],
        *,
        timeout_s: float = 60.0,
    ):
        self.probes = dict(probes)
        self.holders = holders
        self.timeout_s = timeout_s
        self.enabled = bool(self.probes)
        self.woke: dict[tuple[str, str], dict[int, int]] = {}  # (role, what) -> GPU -> bytes its last wake took

    def before_wake(
        self, role: str, what: str, gpus: list[int], need: Mapping[int, float]
    ) -> dict[int, GpuMemory] | None:
        """Raise ``GpuMemoryError`` if a GPU of ``role`` lacks room for ``what``; returns the readings, for
        :meth:`after_wake`. ``need``: GPU -> bytes the plan expects the wake to take (a measured wake wins)."""
        if not self.enabled:
            return None
        readings = {}
        for gpu in gpus:
            memory = self.read(gpu)
            if memory is None:
                if not self.enabled:
                    return None
                continue
            readings[gpu] = memory
            check_room(role, gpu, self.need(role, what, gpu, need), memory, awake=self._others(role, gpu))
        return readings

    def has_room(self, role: str, what: str, gpus: list[int], need: Mapping[int, float]) -> bool:
        """Whether a wake of ``what`` fits now on every GPU of ``role`` (for optional, early wakes)."""
        if not self.enabled:
            return True
        for gpu in gpus:
            memory = self.read(gpu)
            if memory is None:
                return self.enabled is False
            if memory.free < self.need(role, what, gpu, need) + (256 << 20):
                return False
        return True

    def after_wake(self, role: str, what: str, before: dict[int, GpuMemory] | None) -> None:
        if not before:
            return
        taken = {}
        for gpu, reading in before.items():
            now = self.read(gpu)
            if now is not None:
                taken[gpu] = max(reading.free - now.free, 0)
        self.woke[(role, what)] = taken

    def explain_wake_failure(
        self, role: str, what: str, gpus: list[int], need: Mapping[int, float], error: BaseException
    ) -> Exception | None:
        """The guard's error for a wake of ``role`` that ran out of memory (None: not a memory failure, or no
        reading to explain it with; the caller re-raises the original)."""
        if not self.enabled or not is_out_of_memory(error):
            return None
        for gpu in gpus:
            try:
                memory = self.read(gpu)
            except Exception:  # the reading failing must not hide the wake's own error
                return None
            if memory is not None:
                return room_error(
                    role,
                    gpu,
                    self.need(role, what, gpu, need),
                    memory,
                    awake=self._others(role, gpu),
                    failed=_oom_line(error),
                )
        return None

    def read(self, gpu: int) -> GpuMemory | None:
        probe = self.probes.get(gpu)
        if probe is None:
            return None
        name, worker = probe
        answer = get_with_timeout(worker.gpu_memory.remote(), self.timeout_s, f"{name}: gpu_memory")
        if answer is None:
            self.enabled = False  # no CUDA in the workers: nothing to check
            return None
        return GpuMemory(**answer)

    def need(self, role: str, what: str, gpu: int, planned: Mapping[int, float]) -> int:
        measured = self.woke.get((role, what), {}).get(gpu)
        return int(measured if measured is not None else planned.get(gpu, 0))

    def _others(self, role: str, gpu: int) -> dict[str, int | None]:
        return {r: b for r, b in self.holders(gpu).items() if r != role}


def _oom_line(error: BaseException) -> str:
    lines = str(error).splitlines() or [type(error).__name__]
    return next((line for line in lines if "out of memory" in line.lower()), lines[-1])
