"""Build DeepSpeed's just-in-time C++ ops once, in the driver, before any worker starts.

On a machine without CUDA, DeepSpeed compiles its CPU Adam and shared-memory collectives the first time a worker
needs them (about 2-3 minutes on 2 cores). Left to the workers, every trainer role compiles at once behind torch's
lock file, the set-up call can run out of time mid-build, and a worker killed while holding the lock leaves a file
that makes every later run wait forever. Building here, serialised across processes by an OS lock that dies with
its holder, makes the workers' load a quick no-op and lets us clear a lock file nobody can still hold.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

# The ops DeepSpeed loads in a CPU trainer: the DeepSpeed-config Adam and the shared-memory allreduce of deepspeed.comm.
CPU_OPS = ("FusedAdamBuilder", "ShareMemCommBuilder")
# Older than this, torch's build lock cannot belong to a live build (a build takes minutes) - it was left by a kill.
STALE_LOCK_S = 15 * 60


def extensions_dir() -> str:
    """Where torch keeps JIT-built extensions (``TORCH_EXTENSIONS_DIR`` or torch's per-version default)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    # torch's default: <root>/py311_cpu (or _cu130 for a CUDA build of torch)
    cuda = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{py}_{cuda}")


@contextmanager
def _os_lock(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def clear_stale_locks(root: str, max_age_s: float = STALE_LOCK_S) -> list[str]:
    """Remove torch build ``lock`` files older than ``max_age_s`` under ``root``; returns the removed paths."""
    removed: list[str] = []
    if not os.path.isdir(root):
        return removed
    now = time.time()
    for name in os.listdir(root):
        lock = os.path.join(root, name, "lock")
        try:
            age = now - os.path.getmtime(lock)
        except OSError:
            continue
        if age > max_age_s:
            log.warning("removing a stale torch build lock (%.0f min old, left by a killed build): %s", age / 60, lock)
            os.remove(lock)
            removed.append(lock)
    return removed


def ensure_cpu_ops_built(ops: tuple[str, ...] = CPU_OPS) -> float:
    """Compile (or just load) DeepSpeed's CPU ops here; returns the seconds it took. No-op when CUDA is present."""
    import torch

    if torch.cuda.is_available():
        return 0.0  # GPU builds ship prebuilt or compile per worker; nothing here to serialise
    root = extensions_dir()
    start = time.perf_counter()
    with _os_lock(os.path.join(root, ".hybrid-build.lock")):
        clear_stale_locks(root)
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        for op in ops:
            builder = accelerator.create_op_builder(op)
            if builder is None:
                continue
            built = os.path.exists(os.path.join(root, builder.name))
            if not built:
                log.warning("building DeepSpeed's %s once (2-3 min on 2 cores; cached in %s)", builder.name, root)
            builder.load(verbose=False)
    return time.perf_counter() - start
