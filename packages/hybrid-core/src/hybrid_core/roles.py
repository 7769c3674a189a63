"""A role = N Ray workers of one class, one per data-parallel rank, on the bundles the placement plan assigns.

Every call goes through :func:`hybrid_core.remote.get_all_with_timeout`, so a late or dead worker ends the step with
an error naming the role, the method (phase) and the rank — after the stacks of the role's workers are dumped into
the run's log folder.

A role group is also what the residency owner (:mod:`hybrid_core.residency`) moves: its workers implement
``offload(states)`` and ``reload(states)`` (each returns the bytes it moved), and :meth:`RoleGroup.offload` /
:meth:`RoleGroup.reload` start those calls on every rank without waiting.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import RemoteTimeout, RoleFailure
from .faults import maybe_inject
from .remote import get_all_with_timeout
from .runtime_env import worker_runtime_env

if TYPE_CHECKING:
    from .placement.ray_groups import PlacedPlan

log = logging.getLogger(__name__)


#: Answered on the 'control' thread, so a worker busy (or stuck) in a phase still answers them.
CONTROL_METHODS = ("dump_stacks", "ping", "gpu_memory")


def remote_class(worker_cls: type[Any]) -> Any:
    """The worker class as a Ray actor with a 'control' thread for stack dumps, health and memory checks.

    Every other public method is a phase: it first passes :func:`hybrid_core.faults.maybe_inject` (test-only fault
    injection through ``HYBRID_FAULT``; a no-op when unset), and so does the constructor, as phase ``create``."""
    import ray

    members: dict[str, Any] = {
        name: ray.method(concurrency_group="control")(getattr(worker_cls, name)) for name in CONTROL_METHODS
    }
    for name, fn in inspect.getmembers(worker_cls, inspect.isfunction):
        if (
            name.startswith("_")
            or name in CONTROL_METHODS
            or isinstance(inspect.getattr_static(worker_cls, name), staticmethod)
        ):
            continue
        members[name] = _phase(name, fn)
    members["__init__"] = _created(worker_cls.__init__)
    cls = type(worker_cls.__name__, (worker_cls,), members)
    return ray.remote(concurrency_groups={"control": 1})(cls)


#: Calls that are not phases of work: no allocator trim after them.
_NOT_PHASES = ("offload", "reload", "set_residency", "end_phase", "where", "free_port", "setup")


def _created(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def create(self: Any, role: str, rank: int, *args: Any, **kwargs: Any) -> None:
        maybe_inject(role, "create", rank)
        init(self, role, rank, *args, **kwargs)

    return create


def gpu_label(gpus: Sequence[int]) -> str:
    """``GPU 3`` / ``GPUs 2,3``: the plan's GPU numbers (as a dry run shows them), for error messages."""
    gpus = list(gpus)
    return f"GPU {gpus[0]}" if len(gpus) == 1 else f"GPUs {','.join(str(g) for g in gpus)}"


def _phase(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        maybe_inject(self.role, name, self.rank)
        try:
            return fn(self, *args, **kwargs)
        finally:
            end = getattr(self, "end_phase", None)
            if end is not None and name not in _NOT_PHASES:
                end()  # e.g. release the allocator cache when the residency plan needs the room

    return call


class RoleGroup:
    """The workers of one role. ``call`` sends the same arguments to every rank; ``call_sharded`` one shard each.

    Worker ``rank`` is built as ``worker_cls(role, rank, world_size, *args)`` on the bundle the placed plan gives it.
    """

    def __init__(self, role: str, worker_cls: type[Any], placed: PlacedPlan, *args: Any, timeout_s: float):
        self.role = role
        self.timeout_s = timeout_s
        placement = placed.plan.roles[role]
        self.world_size = len(placement.workers)
        self.gpus = sorted({g for w in placement.workers for g in w.gpus})
        self.rank_gpus = [list(w.gpus) for w in placement.workers]
        actor_cls = remote_class(worker_cls)
        self.workers = [
            actor_cls.options(
                **placed.actor_options(role, rank), runtime_env=worker_runtime_env(), name=None, max_restarts=0
            ).remote(role, rank, self.world_size, *args)
            for rank in range(self.world_size)
        ]

    def name(self, rank: int, method: str) -> str:
        """How errors name a call: ``actor rank 1: train on GPU 1``."""
        gpus = self.rank_gpus[rank] if rank < len(self.rank_gpus) else []
        return f"{self.role} rank {rank}: {method}" + (f" on {gpu_label(gpus)}" if gpus else "")

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        refs = [(self.name(r, method), getattr(w, method).remote(*args, **kwargs)) for r, w in enumerate(self.workers)]
        return self._wait(refs, timeout_s)

    def call_sharded(
        self, method: str, shards: Sequence[Any], *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        if len(shards) != self.world_size:
            raise ValueError(f"{self.role}: {len(shards)} shards for {self.world_size} ranks")
        refs = [
            (self.name(r, method), getattr(w, method).remote(shard, *args, **kwargs))
            for r, (w, shard) in enumerate(zip(self.workers, shards))
        ]
        return self._wait(refs, timeout_s)

    # ---- residency (started here, waited for by the owner) ---------------------------------------------------------
    def offload(self, states: Sequence[str], moves: Any = None) -> list[tuple[str, Any]]:
        return [
            (self.name(r, f"offload {'+'.join(states)}"), w.offload.remote(list(states)))
            for r, w in enumerate(self.workers)
        ]

    def reload(self, states: Sequence[str]) -> list[tuple[str, Any]]:
        return [
            (self.name(r, f"reload {'+'.join(states)}"), w.reload.remote(list(states)))
            for r, w in enumerate(self.workers)
        ]

    def _wait(self, named_refs: Sequence[tuple[str, Any]], timeout_s: float | None) -> list[Any]:
        try:
            return get_all_with_timeout(named_refs, timeout_s or self.timeout_s)
        except (RemoteTimeout, RoleFailure):
            self.dump_stacks()
            raise

    def dump_stacks(self, timeout_s: float = 10.0) -> None:
        """Ask every worker for its Python stacks (written to the run's log folder); never raises."""
        import ray

        refs = [w.dump_stacks.remote() for w in self.workers]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        except Exception:  # a dead worker cannot dump; the error that brought us here says enough
            log.debug("stack dump of %s failed", self.role, exc_info=True)

    def kill(self) -> None:
        """End every worker process now (a dead one is skipped): no call of theirs is waited for."""
        import ray

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already gone, or Ray itself is: the tear-down goes on
                log.debug("killing a %s worker failed", self.role, exc_info=True)
