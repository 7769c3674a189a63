"""Is there room on a GPU to wake a role? Checked before the wake, so a shortage is a clear error naming who holds
the memory instead of a CUDA out-of-memory error deep inside an engine or DeepSpeed.

:func:`check_room` is the decision (plain numbers, testable anywhere); :func:`probe` reads the numbers of the
current process's GPU (None on a machine without CUDA, where the check is skipped).
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import GpuMemoryError

GIB = 1 << 30
#: Wake needs its footprint plus this much: allocator fragmentation and the first kernels' workspaces.
DEFAULT_HEADROOM = 256 << 20


@dataclass(frozen=True)
class GpuMemory:
    """What one GPU has free / in total, and (when nvidia tools can tell) which processes use it."""

    free: int
    total: int
    processes: str | None = None


def check_room(
    role: str,
    gpu: int,
    need: int,
    memory: GpuMemory,
    *,
    awake: Mapping[str, int | None],
    headroom: int = DEFAULT_HEADROOM,
) -> None:
    """Raise :class:`GpuMemoryError` unless ``need`` + ``headroom`` bytes are free on ``gpu``.

    ``awake``: the other roles that may hold memory on that GPU now -> their footprint in bytes (None: unknown).
    """
    if need <= 0 or memory.free >= need + headroom:
        return
    raise room_error(role, gpu, need, memory, awake=awake, headroom=headroom)


def room_error(
    role: str,
    gpu: int,
    need: int,
    memory: GpuMemory,
    *,
    awake: Mapping[str, int | None],
    headroom: int = DEFAULT_HEADROOM,
    failed: str | None = None,
) -> GpuMemoryError:
    """The error for a role that cannot wake on ``gpu``: what it needs, what is free, who holds the rest, the fix.

    ``failed``: the allocator's own message when the wake itself ran out of memory (another process took the memory
    between the check and the wake); the error then says so and quotes it.
    """
    holders = [f"{name} ({_gib(size)})" if size else name for name, size in awake.items() if name != role]
    who = ("awake on it: " + ", ".join(holders)) if holders else "no other hybrid role is awake on it"
    if memory.processes:
        who += f"; processes on the GPU: {memory.processes}"
    # Sleeping another role helps only if it holds what is missing; otherwise the memory is someone else's.
    short = need + headroom - memory.free
    biggest = max(
        (r for r, s in awake.items() if r != role and s and s >= short), key=lambda r: awake[r] or 0, default=None
    )
    fix = (
        f"make {biggest} sleep before {role}'s turn (sleep flags, colocation), "
        if biggest
        else "free the GPU from other jobs (see the processes), "
    )
    needs = f"it needs {_gib(need)} (+ {_gib(headroom)} headroom)" if need > 0 else "it needs more memory"
    ran_out = f"; the wake ran out of memory ({failed.strip()[:300]})" if failed else ""
    return GpuMemoryError(
        f"{role} cannot wake on GPU {gpu}: {needs} but only {_gib(memory.free)} of {_gib(memory.total)} is free"
        f"{ran_out}; {who}. Fix: {fix}or lower the memory the roles take "
        "(engine.gpu_memory_utilization, trainer.zero_stage 3, trainer.adam_offload, a smaller micro batch)."
    )


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it, through remote-call wrappers) is a device out-of-memory error."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = f"{type(current).__name__} {current}".lower()
        if "outofmemory" in text or "out of memory" in text:
            return True
        current = current.__cause__ or current.__context__
    return False


def probe(device: Any = None) -> GpuMemory | None:
    """Free/total bytes of this process's CUDA device (and the GPU's process list when available); None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(int(free), int(total), gpu_processes(device))


def gpu_processes(device: Any) -> str | None:
    """``pid (used)`` of each process on the GPU, through torch (pynvml) or nvidia-smi; None if neither can tell."""
    import torch

    try:
        text = torch.cuda.list_gpu_processes(device)
        lines = [line.strip() for line in text.splitlines()[1:] if line.strip()]
        if lines and "pynvml" not in text:
            return "; ".join(lines)
    except Exception:  # no pynvml: try the command-line tool
        pass
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        select = [f"--id=GPU-{uuid}"] if uuid and not uuid.startswith("GPU-") else ([f"--id={uuid}"] if uuid else [])
        out = subprocess.run(
            ["nvidia-smi", *select, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        return "; ".join(lines) or None
    except Exception:  # no nvidia-smi either: the roles' own figures must do
        return None


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
