"""Refining a residency plan from what the GPUs really hold, after steps 1, 2, 4, 8, ... of a run.

A reading of each GPU (total - free: every process on it) is compared with what the memory model counts on that GPU
*at the moment of the reading*; the difference -- CUDA contexts beyond the estimate, library buffers, the
allocator's fragmentation, another process -- is the plan's measured overhead, held in every phase, and the plan is
made again with it::

    owner.settle()                                       # every move has landed
    used = {gpu: reading.total - reading.free ...}       # guard.read(gpu)
    result = refine_plan(plan, used, phase=owner.phase, on_gpu=owner.on_gpu(), replan=..., after_step=1)

What the model counts at that moment is what the residency owner has on the GPU (its record of each role's states),
not what the plan keeps in the phase just run: the owner brings back early what the next phase needs where it fits
(an engine's KV cache wakes during the sync, for the generate after it). Counting the phase instead took a 42 GiB KV
cache for overhead and added it to every phase again -- the generate, which holds that KV cache already, then
"needed" 96.5 GiB of a 72.8 GiB budget where 56.5 GiB was measured (4x H100: actor, reference, reward and four vLLM
engines on every GPU), and the plan offloaded two models a step for nothing.

The overhead only grows (the largest seen; the plan's own overhead is never part of what the model counts, so it is
not counted twice), and a refined plan that does not fit stops the run with the numbers: it never runs on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..errors import PlacementError
from .memory import GiB
from .plan import ResidencyPlan

log = logging.getLogger(__name__)

#: Growth of the overhead (fraction of a GPU) below which no new plan is made: the readings jitter.
JITTER = 0.01
#: The note a refinement leaves on its plan (a later refinement replaces it).
NOTE = "refined after step"


@dataclass(frozen=True)
class Refinement:
    """What one refinement found: the overhead per GPU, the plan to run with (the same one when nothing grew enough
    to re-plan) and whether it was made again / moves differently."""

    overhead: dict[int, float]
    plan: ResidencyPlan
    replanned: bool
    changed: bool

    @property
    def largest(self) -> float:
        return max(self.overhead.values(), default=0.0)


def held(
    plan: ResidencyPlan, gpu: int, phase: str, on_gpu: Mapping[str, Iterable[str]]
) -> dict[tuple[str, str], float]:
    """(role, item) -> bytes the memory model counts on ``gpu`` once ``phase`` has run and every move has landed.

    ``on_gpu``: role -> the states on its GPUs (the owner's record, :meth:`~.owner.ResidencyOwner.on_gpu`; a role it
    does not name: what the plan keeps in ``phase``). Besides those states: the allocator cache of the roles that
    keep theirs (the larger of their largest working set and this phase's, which the cache now holds; a role that
    trims has none), and every worker's context. The plan's measured overhead is not in it."""
    items: dict[tuple[str, str], float] = {}
    for share in plan.layout[gpu]:
        size, n, role = share.size, share.workers, share.role
        states = on_gpu.get(role)
        for state in plan.resident_states(role, phase) if states is None else states:
            if state != "cache" and size.states.get(state):
                items[(role, state)] = size.states[state] * n
        if plan.move(role, "cache") == "resident":  # not trimmed after its phases (see ResidencyPlan.breakdown)
            works = any(p.name == phase and role in p.needs for p in plan.phases)
            kept = max(size.states.get("cache", 0.0), size.working_total(phase) if works else 0.0)
            if kept:
                items[(role, "cache")] = kept * n
        items[(role, "context")] = size.context * n
    return items


def measured_overhead(
    plan: ResidencyPlan, used: Mapping[int, float], phase: str, on_gpu: Mapping[str, Iterable[str]]
) -> dict[int, float]:
    """GPU -> bytes in use beyond what the model counts (``used``: total - free per GPU), never below the plan's
    overhead from an earlier reading (memory reserved once may be reserved again at a later peak)."""
    return {
        gpu: max(used[gpu] - sum(held(plan, gpu, phase, on_gpu).values()), plan.overhead.get(gpu, 0.0), 0.0)
        for gpu in used
    }


def refine_plan(
    plan: ResidencyPlan,
    used: Mapping[int, float],
    *,
    phase: str | None,
    on_gpu: Mapping[str, Iterable[str]],
    replan: Callable[[dict[int, float]], ResidencyPlan],
    after_step: int,
) -> Refinement:
    """Measure the overhead (:func:`measured_overhead`) and, when it grew, make the plan again with it (``replan``:
    overhead -> plan, the run's planner with its settings). Raises a :class:`PlacementError` with the readings and the
    refined plan's numbers when no plan fits with the overhead. ``phase``: the phase run last (None: the step's
    last)."""
    phase = phase or plan.phases[-1].name
    overhead = measured_overhead(plan, used, phase, on_gpu)
    grown = max((overhead[g] - plan.overhead.get(g, 0.0) for g in overhead), default=0.0)
    if plan.overhead and grown < JITTER * plan.gpu_bytes:  # nothing worth a new plan
        return Refinement(overhead, plan, replanned=False, changed=False)
    refined = replan(overhead)
    try:
        refined.check()
    except PlacementError as error:
        raise PlacementError(
            error.field,
            f"{_reading(plan, used, phase, on_gpu, overhead, after_step)}; with it in "
            f"every phase no plan fits: {error.problem}",
            f"{error.fix or ''} Or free the GPUs of other processes (the reading counts every "
            "process on the GPU).".strip(),
        ) from error
    changed = refined.moves != plan.moves
    refined.notes = [n for n in plan.notes if not n.startswith(NOTE)] + [
        f"{NOTE} {after_step}: measured {max(overhead.values()) / GiB:.2f} GiB per GPU beyond the model"
        + ("; the moves changed" if changed else "")
    ]
    if changed:
        log.warning(
            "residency plan changed after step %d (%.2f GiB beyond the model):\n%s",
            after_step,
            max(overhead.values()) / GiB,
            refined.render(),
        )
    return Refinement(overhead, refined, replanned=True, changed=changed)


def _reading(
    plan: ResidencyPlan,
    used: Mapping[int, float],
    phase: str,
    on_gpu: Mapping[str, Iterable[str]],
    overhead: Mapping[int, float],
    after_step: int,
) -> str:
    """The reading behind the largest overhead, in words: in use, counted (by what), the difference."""
    gpu = max(overhead, key=lambda g: overhead[g])
    items = held(plan, gpu, phase, on_gpu)
    counted = sum(items.values())
    parts = ", ".join(
        f"{role} {item} {v / GiB:.1f}"
        for (role, item), v in sorted(items.items(), key=lambda kv: -kv[1])
        if v >= 0.05 * GiB
    )
    beyond = f"{overhead[gpu] / GiB:.2f} GiB beyond the model"
    if overhead[gpu] > used[gpu] - counted + (1 << 20):
        beyond = f"{(used[gpu] - counted) / GiB:.2f} GiB beyond the model ({beyond} at an earlier reading, kept)"
    return (
        f"after step {after_step}, GPU {gpu} had {used[gpu] / GiB:.2f} GiB in use where the model counts "
        f"{counted / GiB:.2f} GiB ({parts} GiB): {beyond}"
    )
