"""Python stacks of any hybrid worker process on request, even one stuck in C code or on its only thread.

Every Ray worker hybrid starts runs :func:`install` before its actor is built (Ray's worker-process setup hook, set
by :mod:`hybrid_core.runtime_env`): faulthandler then writes all threads' stacks on ``SIGUSR1``, and on a hard
crash, into ``stacks-pid<PID>.txt`` in ``$HYBRID_STACKS_DIR`` (the run's log folder; stderr, i.e. Ray's worker log,
when unset). :func:`request_dump` sends that signal from the driver, to a process on any node. Signal handling of
faulthandler is C-level, so it answers where a Python-level "dump your stacks" call would queue behind the hang.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from typing import Any

log = logging.getLogger(__name__)

DIR_ENV = "HYBRID_STACKS_DIR"
DUMP_SIGNAL = signal.SIGUSR1
_file: Any = None


def stack_file(directory: str, pid: int) -> str:
    return os.path.join(directory, f"stacks-pid{pid}.txt")


def install() -> None:
    """Register the dump-on-signal and dump-on-crash handlers in this process (idempotent)."""
    global _file
    directory = os.environ.get(DIR_ENV)
    target = sys.stderr
    if directory:
        try:
            os.makedirs(directory, exist_ok=True)
            if _file is None:
                # kept open for the process's life (no `with`): the handler writes to its fd
                _file = open(stack_file(directory, os.getpid()), "a")  # noqa: SIM115
            target = _file
        except OSError:  # an unwritable folder must not keep the worker from starting
            log.warning("cannot write stack dumps to %s; using stderr", directory)
    faulthandler.enable(target, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=target, all_threads=True, chain=False)


def request_dump(pid: int, node_ip: str | None = None, timeout_s: float = 10.0) -> bool:
    """Ask process ``pid`` (on the node at ``node_ip``; default this one) to write its stacks; never raises.

    Only send this to processes started with :func:`hybrid_core.runtime_env.worker_runtime_env` (which installs
    the handler): without one, the signal's default action ends the process.
    """
    try:
        import ray

        here = ray.util.get_node_ip_address() if ray.is_initialized() else None
        if node_ip is None or node_ip == here or not ray.is_initialized():
            return _signal(pid)
        node_id = next(
            (n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeManagerAddress"] == node_ip), None
        )
        if node_id is None:
            return False
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        ref = ray.remote(num_cpus=0)(_signal).options(scheduling_strategy=strategy).remote(pid)
        return bool(ray.get(ref, timeout=timeout_s))
    except Exception:  # diagnosis after a failure: report the failure, not this
        log.debug("stack dump request to pid %s failed", pid, exc_info=True)
        return False


def _signal(pid: int) -> bool:
    """Signal ``pid`` if it is still a Ray worker (a dead worker's pid may already belong to another program)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"ray::" not in f.read():
                return False
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): trust the pid
        pass
    try:
        os.kill(pid, DUMP_SIGNAL)
        return True
    except ProcessLookupError:
        return False
