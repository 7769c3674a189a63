"""Before a role wakes, check its GPUs have room for it (``hybrid_core.gpu_memory.check_room``).

What a role needs is what it took the last time it woke the same way (free memory before minus after, measured on
its GPU), or before any such wake, what its last sleep freed. The roles that may hold the memory are the ones the
loop knows to be awake on that GPU (those that never sleep, and the sleeping role whose turn it is), each with its
footprint. Free memory is read by a role worker on that GPU (a control-thread call, answered even mid-phase); on a
machine without CUDA the first probe says so and the guard turns itself off.

The check cannot stop another process from taking the memory between the reading and the wake (seen on an H200: a
neighbour job grabbing what a sleep freed). So a wake that fails for want of memory is explained the same way, from a
fresh reading: :meth:`WakeGuard.explain_wake_failure`.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from hybrid_core.gpu_memory import GpuMemory, check_room, is_out_of_memory, room_error
from hybrid_core.remote import get_with_timeout

log = logging.getLogger(__name__)


class WakeGuard:
    def __init__(self, plan: Any, groups: Iterable[Any], *, timeout_s: float = 60.0):
        self.plan = plan
        self.timeout_s = timeout_s
        self.enabled = True
        self.probes: dict[int, tuple[str, Any]] = {}  # plan GPU -> (name, worker handle with gpu_memory())
        for group in groups:
            for rank, worker in enumerate(group.workers):
                for gpu in plan.roles[group.role].workers[rank].gpus:
                    self.probes.setdefault(gpu, (f"{group.role} rank {rank}", worker))
        self.slept: dict[str, dict[int, int]] = {}  # role -> GPU -> bytes its last sleep freed there
        self.woke: dict[tuple[str, str], dict[int, int]] = {}  # (role, kind) -> GPU -> bytes its last wake took
        self.awake = {role for role, placement in plan.roles.items() if not placement.sleeps}

    # ---- bookkeeping ------------------------------------------------------------------------------------------------
    def gpus_of(self, role: str) -> list[int]:
        return sorted({g for w in self.plan.roles[role].workers for g in w.gpus})

    def after_sleep(self, role: str, results: Any) -> None:
        """Record what each rank's sleep freed (``results``: one TransferStats / dict per rank or engine)."""
        self.awake.discard(role)
        per_gpu: dict[int, int] = {}
        for worker, result in zip(self.plan.roles[role].workers, results if isinstance(results, list) else [results]):
            moved = _bytes_of(result)
            for gpu in worker.gpus:
                per_gpu[gpu] = per_gpu.get(gpu, 0) + moved // max(len(worker.gpus), 1)
        if any(per_gpu.values()):
            self.slept[role] = per_gpu

    def mark_awake(self, role: str, awake: bool = True) -> None:
        """For wakes and sleeps that happen outside a turn (the engines' weights during a weight sync)."""
        (self.awake.add if awake else self.awake.discard)(role)

    # ---- the check --------------------------------------------------------------------------------------------------
    def before_wake(self, role: str, kind: str = "all") -> dict[int, GpuMemory] | None:
        """Raise ``GpuMemoryError`` if a GPU of ``role`` lacks room; returns the readings for :meth:`after_wake`."""
        if not self.enabled:
            self.awake.add(role)
            return None
        readings = {}
        for gpu in self.gpus_of(role):
            memory = self.read(gpu)
            if memory is None:
                if not self.enabled:
                    self.awake.add(role)
                    return None
                continue
            readings[gpu] = memory
            check_room(role, gpu, self._need(role, kind, gpu), memory, awake=self._holders(gpu))
        self.awake.add(role)
        return readings

    def explain_wake_failure(self, role: str, kind: str, error: BaseException) -> Exception | None:
        """The guard's error for a wake of ``role`` that ran out of memory (None: not a memory failure, or no
        reading to explain it with; the caller re-raises the original)."""
        if not self.enabled or not is_out_of_memory(error):
            return None
        for gpu in self.gpus_of(role):
            try:
                memory = self.read(gpu)
            except Exception:  # the reading failing must not hide the wake's own error
                return None
            if memory is not None:
                return room_error(role, gpu, self._need(role, kind, gpu), memory, awake=self._holders(gpu),
                                  failed=_oom_line(error))
        return None

    def after_wake(self, role: str, kind: str, before: dict[int, GpuMemory] | None) -> None:
        if not before:
            return
        taken = {}
        for gpu, reading in before.items():
            now = self.read(gpu)
            if now is not None:
                taken[gpu] = max(reading.free - now.free, 0)
        self.woke[(role, kind)] = taken

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

    def _need(self, role: str, kind: str, gpu: int) -> int:
        need = self.woke.get((role, kind), {}).get(gpu)
        if need is None and kind == "all":
            need = self.slept.get(role, {}).get(gpu, 0)
        return need or 0

    def _holders(self, gpu: int) -> dict[str, int | None]:
        return {r: self._footprint(r, gpu) for r in sorted(self.awake) if gpu in self.gpus_of(r)}

    def _footprint(self, role: str, gpu: int) -> int | None:
        woke = [taken[gpu] for (r, _), taken in self.woke.items() if r == role and gpu in taken]
        return max(woke + [self.slept.get(role, {}).get(gpu, 0)]) or None


def _oom_line(error: BaseException) -> str:
    lines = str(error).splitlines() or [type(error).__name__]
    return next((line for line in lines if "out of memory" in line.lower()), lines[-1])


def _bytes_of(result: Any) -> int:
    if isinstance(result, dict):
        return int(result.get("bytes", 0))
    return int(getattr(result, "bytes", 0) or 0)
