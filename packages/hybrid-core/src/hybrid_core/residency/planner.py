"""The planner: from the memory model and a GPU's capacity, decide for every (role, state) whether it stays on the
GPU or moves between the phases that need it -- moving as little as possible.

Modes:

* ``auto`` -- keep everything resident when it fits. Otherwise the cheapest set of moves that makes every phase fit,
  cost counted in bytes over PCIe per step (an offload costs twice a state's bytes per stretch it is away; freeing
  an engine's KV cache or an allocator cache costs nothing but a call; discarding engine weights costs nothing,
  since the weight sync after the update overwrites them anyway -- so it beats a level-1 offload, which copies them
  to host and back only to have them overwritten). Among plans of equal cost, fewer moves win. Keeping the optimizer
  in host memory for the whole run (CPU Adam) is the last resort: it is chosen only when nothing else fits.
* ``all-sleep`` -- every state of every role that shares a GPU moves (the behaviour before the planner existed).
* ``manual`` -- only the roles in ``sleep_roles`` move (the sleep switches, :mod:`.settings`: ``engine.sleep`` ->
  the engines, their weights by ``engine.sleep_level``; ``residency.trainer_sleep`` -> the trainers); everything
  else stays.

In ``auto`` mode ``sleep_roles`` are roles the user asked to sleep: their states move, the planner decides the rest.
``pins`` fix single decisions in any mode (``{("actor", "optimizer"): "offload"}``). A role alone on its GPUs never
moves anything (that would free memory for nobody).
The search visits plans in increasing cost (a best-first walk over the per-state choices), so the first plan that
fits is the cheapest one; sizes are summed with numpy, one vector per choice.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import ConfigError
from .host import HostBudget
from .memory import GpuShare, ModelShape, Workload, size_role
from .plan import ResidencyPlan, tracked
from .steps import STATE_MOVES, Phase, absent_runs, check_phases, needed_in, present_phases

MODES = ("auto", "all-sleep", "manual")
#: Fraction of a GPU a plan may use: the rest absorbs what the model does not count (fragmentation, kernels'
#: workspaces, library pools).
DEFAULT_USABLE = 0.92
#: Cost of one move in bytes-equivalent (a call into the role and its synchronisation), so that among plans moving
#: the same bytes the one with fewer moves wins.
MOVE_COST = 64 << 20
#: Keeping the optimizer in host memory makes every optimizer step run on the CPU: only when nothing else fits.
HOST_COST = 1 << 60


def build_layout(
    placement: Any,
    shapes: Mapping[str, ModelShape],
    work: Workload,
    gpu_bytes: float,
    *,
    kinds: Mapping[str, str],
    phases: tuple[Phase, ...],
) -> dict[int, tuple[GpuShare, ...]]:
    """GPU -> the roles on it (from a :class:`~hybrid_core.placement.PlacementPlan`), sized by the memory model:
    ``kinds`` says each role's kind, ``phases`` the step (each role's working memory is counted where it works)."""
    missing = sorted(set(placement.roles) - set(kinds))
    if missing:
        raise ValueError(f"no kind given for role(s) {', '.join(missing)} (kinds: trainer, frozen, engine)")
    sizes = {
        role: size_role(
            role,
            shapes[role],
            work,
            kind=kinds[role],
            phases=phases,
            ranks=len(rp.workers),
            tp=rp.tp,
            gpu_bytes=gpu_bytes,
        )
        for role, rp in placement.roles.items()
    }
    layout: dict[int, list[GpuShare]] = {}
    for role, rp in placement.roles.items():
        count: dict[int, int] = {}
        for worker in rp.workers:
            for gpu in worker.gpus:
                count[gpu] = count.get(gpu, 0) + 1
        for gpu, n in count.items():
            layout.setdefault(gpu, []).append(GpuShare(sizes[role], n))
    return {g: tuple(shares) for g, shares in sorted(layout.items())}


def plan_residency(
    layout: Mapping[int, tuple[GpuShare, ...]],
    gpu_bytes: float,
    *,
    phases: Iterable[Phase],
    mode: str = "auto",
    pins: Mapping[tuple[str, str], Any] | None = None,
    sleep_roles: Iterable[str] = (),
    engine_sleep_level: int = 1,
    usable: float = DEFAULT_USABLE,
    allow_host: bool = True,
    overhead: Mapping[int, float] | None = None,
    sleep_fields: Mapping[str, str] | None = None,
    host: HostBudget | None = None,
) -> ResidencyPlan:
    """The residency plan for ``layout`` on GPUs of ``gpu_bytes`` (see the module docstring). ``phases``: the step,
    in order (:class:`~.steps.Phase`; those whose working role is not in ``layout`` are skipped). ``overhead``: GPU ->
    bytes measured beyond the model (a run's refinements after steps 1, 2, 4, 8, ...), held in every phase.
    ``sleep_fields``: role -> the user's setting that asked it to sleep (named by the error when such a role shares
    no GPU). ``host``: each node's host memory (the plan shows and checks what it keeps there, see :mod:`.host`)."""
    if mode not in MODES:
        raise ConfigError("residency.mode", f"unknown mode {mode!r}.", f"Use one of: {', '.join(MODES)}.")
    if not 0 < usable <= 1:
        raise ConfigError("usable", f"must be in (0, 1], got {usable}.")
    layout = {g: tuple(s) for g, s in layout.items()}
    roles = tuple(dict.fromkeys(s.role for shares in layout.values() for s in shares))
    phases = present_phases(phases, roles)
    check_phases(phases, {s.role: s.size.kind for shares in layout.values() for s in shares})
    capacity = gpu_bytes * usable
    pins = dict(pins or {})
    _check_pins(pins, layout)
    shared = _shared_roles(layout)
    check_sleepers(set(sleep_roles) & set(roles), shared, sleep_fields)
    choices = _choices(layout, phases, mode, pins, set(sleep_roles), shared, engine_sleep_level, allow_host)
    notes: list[str] = []
    overhead = {g: float(v) for g, v in (overhead or {}).items() if v}
    if mode != "auto":
        fixed = {key: options[0] for key, options in choices.items()}
        return ResidencyPlan(
            mode, phases, fixed, dict(layout), gpu_bytes, capacity, notes, overhead=overhead, host=host
        )
    moves = _cheapest_fit(layout, phases, choices, capacity, gpu_bytes, overhead)
    if moves is None:  # nothing fits: return the plan that moves the most, so the error shows the smallest peak
        moves = {key: _most_moving(options) for key, options in choices.items()}
        notes.append("no plan fits the GPUs; this one moves everything it can")
    plan = ResidencyPlan(mode, phases, moves, dict(layout), gpu_bytes, capacity, notes, overhead=overhead, host=host)
    for (role, _state), move in moves.items():
        if move == "host":
            plan.notes.append(
                f"{role}'s optimizer state stays in host memory (CPU Adam): it does not fit on the GPU in any plan"
            )
    return plan


# ---- the search ----------------------------------------------------------------------------------------------------
def _cheapest_fit(
    layout: Mapping[int, tuple[GpuShare, ...]],
    phases: tuple[Phase, ...],
    choices: dict[tuple[str, str], tuple[str, ...]],
    capacity: float,
    gpu_bytes: float,
    overhead: Mapping[int, float],
) -> dict[tuple[str, str], str] | None:
    keys = list(choices)
    groups = _gpu_groups(layout, overhead)  # identical GPUs are checked once
    columns = [(g, p.name) for g in groups for p in phases]
    base = np.array([_base_bytes(layout, g, p) + overhead.get(g, 0.0) for g in groups for p in phases])
    usable = capacity / gpu_bytes if gpu_bytes else 1.0
    vectors, costs = [], []
    for key in keys:
        vs, cs = [], []
        for move in choices[key]:
            vs.append(np.array([_state_bytes(layout, g, p, key, move, phases, usable) for g, p in columns]))
            cs.append(_move_cost(layout, phases, key, move))
        order = sorted(range(len(cs)), key=lambda i: cs[i])  # each state's options, cheapest first
        choices[key] = tuple(choices[key][i] for i in order)
        vectors.append([vs[i] for i in order])
        costs.append([cs[i] for i in order])
    start = (0,) * len(keys)
    heap = [(sum(c[0] for c in costs), 0, start)]
    seen = {start}
    tie = itertools.count(1)
    while heap:
        cost, _, index = heapq.heappop(heap)
        total = base + sum((vectors[k][i] for k, i in enumerate(index)), np.zeros(len(columns)))
        moves = {key: choices[key][i] for key, i in zip(keys, index)}
        if (total <= capacity + 1.0).all() and consistent(moves):
            return moves
        for k in range(len(keys)):
            if index[k] + 1 < len(choices[keys[k]]):
                nxt = (*index[:k], index[k] + 1, *index[k + 1 :])
                if nxt not in seen:
                    seen.add(nxt)
                    step = costs[k][index[k] + 1] - costs[k][index[k]]
                    heapq.heappush(heap, (cost + step, next(tie), nxt))
    return None


def consistent(moves: Mapping[tuple[str, str], str]) -> bool:
    """Engines free their KV cache whenever their weights leave (no engine can hold a KV cache without weights)."""
    return all(
        moves.get((role, "kv_cache"), "release") != "resident"
        for (role, state), move in moves.items()
        if state == "weights" and move != "resident"
    )


def _gpu_groups(layout: Mapping[int, tuple[GpuShare, ...]], overhead: Mapping[int, float] | None = None) -> list[int]:
    """One GPU per group of GPUs that hold the same roles with the same sizes (and the same measured overhead)."""
    seen: dict[tuple[Any, ...], int] = {}
    for gpu, shares in layout.items():
        key = (*((s.role, s.workers, id(s.size)) for s in shares), (overhead or {}).get(gpu, 0.0))
        seen.setdefault(key, gpu)
    return list(seen.values())


def _base_bytes(layout: Mapping[int, tuple[GpuShare, ...]], gpu: int, phase: Phase) -> float:
    """What a GPU holds in a phase whatever the plan: contexts and the working memory of the roles at work."""
    total = 0.0
    for share in layout[gpu]:
        total += share.size.context * share.workers
        if share.role in phase.needs:
            total += share.size.working_total(phase.name) * share.workers
    return total


def _state_bytes(
    layout: Mapping[int, tuple[GpuShare, ...]],
    gpu: int,
    phase: str,
    key: tuple[str, str],
    move: str,
    phases: tuple[Phase, ...],
    usable: float,
) -> float:
    """A state's bytes on ``gpu`` in ``phase`` under ``move``, as the capacity counts them (see ResidencyPlan.load)."""
    role, state = key
    plan = ResidencyPlan("auto", phases, {key: move}, dict(layout), 0.0, 0.0)
    total = 0.0
    for share in layout[gpu]:
        if share.role != role:
            continue
        if plan.present(role, state, phase):
            scale = usable if state in share.size.exact else 1.0
            total += share.size.states.get(state, 0.0) * share.workers * scale
        elif (
            state == "cache"
            and move == "resident"
            and share.size.working.get(phase)
            and any(p.name == phase and role in p.needs for p in phases)
        ):
            # working again while the allocator still holds its largest working set (see ResidencyPlan.breakdown)
            total += max(share.size.states["cache"] - share.size.working_total(phase), 0.0) * share.workers
    return total


def _move_cost(
    layout: Mapping[int, tuple[GpuShare, ...]], phases: tuple[Phase, ...], key: tuple[str, str], move: str
) -> float:
    role, state = key
    if move == "resident":
        return 0.0
    if move == "host":
        return float(HOST_COST)
    nbytes = max(
        (s.size.states.get(state, 0.0) * s.workers for shares in layout.values() for s in shares if s.role == role),
        default=0.0,
    )
    if move == "offload":
        plan = ResidencyPlan("auto", phases, {key: move}, dict(layout), 0.0, 0.0)
        present = frozenset(p.name for p in phases if plan.present(role, state, p.name))
        return 2 * nbytes * max(absent_runs(phases, present), 1) + MOVE_COST
    if state == "cache":
        return MOVE_COST + 0.02 * nbytes  # the allocator grows it again next step (cudaMalloc)
    return float(MOVE_COST)  # discard / release: no copy


def plan_cost(plan: ResidencyPlan) -> float:
    """What the planner minimises: bytes over PCIe per step, plus a fixed cost per move (see the module docstring)."""
    return sum(_move_cost(plan.layout, plan.phases, key, move) for key, move in plan.moves.items())


def _most_moving(options: tuple[str, ...]) -> str:
    moving = [o for o in options if o != "host"]
    return moving[-1] if moving else options[0]


# ---- what may move -------------------------------------------------------------------------------------------------
def _choices(
    layout: Mapping[int, tuple[GpuShare, ...]],
    phases: tuple[Phase, ...],
    mode: str,
    pins: Mapping[tuple[str, str], Any],
    sleep_roles: set[str],
    shared: set[str],
    engine_sleep_level: int,
    allow_host: bool,
) -> dict[tuple[str, str], tuple[str, ...]]:
    """For each (role, state) with bytes on a GPU: the moves allowed (exactly one, except in auto mode)."""
    out: dict[tuple[str, str], tuple[str, ...]] = {}
    for shares in layout.values():
        for share in shares:
            role = share.role
            for state, nbytes in share.size.states.items():
                key = (role, state)
                if key in out or not (nbytes or tracked(state)):
                    continue
                if key in pins:
                    pinned = pins[key]
                    out[key] = (pinned,) if isinstance(pinned, str) else tuple(pinned)
                elif state != "cache" and not needed_in(phases, role, state):
                    out[key] = ("resident",)  # no phase of this run uses it: moving it would be pointless
                elif role not in shared:
                    out[key] = ("resident",)  # alone on its GPUs: moving frees memory for nobody
                elif role in sleep_roles or mode == "all-sleep":
                    out[key] = (sleep_move(state, engine_sleep_level),)
                elif mode == "manual":
                    out[key] = ("release",) if state == "cache" else ("resident",)
                else:
                    out[key] = tuple(m for m in STATE_MOVES[state] if m != "host" or allow_host)
    return out


def sleep_move(state: str, engine_sleep_level: int = 1) -> str:
    """How a state leaves when its role sleeps whole (OpenRLHF's sleep flags, ``all-sleep``)."""
    if state == "weights":
        return "offload" if engine_sleep_level == 1 else "discard"
    return "release" if state in ("kv_cache", "cache") else "offload"


def check_sleepers(
    sleep_roles: Iterable[str], shared: Iterable[str], sleep_fields: Mapping[str, str] | None = None
) -> None:
    """A role asked to sleep must share a GPU: alone, sleeping frees memory for nobody. ``sleep_fields``: role -> the
    setting that asked (named by the error)."""
    lonely = sorted(set(sleep_roles) - set(shared))
    if lonely:
        fields = dict.fromkeys((sleep_fields or {}).get(r, "residency.mode") for r in lonely)
        raise ConfigError(
            " / ".join(fields),
            f"{', '.join(lonely)} shares no GPU with another role, so sleeping "
            "would free memory for nobody and only cost a reload per step.",
            f"Drop {' / '.join(fields)}, or colocate it with another role "
            "(placement.colocate_all, or overlapping GPU ranges in placement.ranges).",
        )


def _shared_roles(layout: Mapping[int, tuple[GpuShare, ...]]) -> set[str]:
    return {s.role for shares in layout.values() if len({x.role for x in shares}) > 1 for s in shares}


def _check_pins(pins: Mapping[tuple[str, str], Any], layout: Mapping[int, tuple[GpuShare, ...]]) -> None:
    roles = {s.role: s.size for shares in layout.values() for s in shares}
    for (role, state), pinned in pins.items():
        if role not in roles:
            raise ConfigError(
                "residency",
                f"{role}.{state}: there is no role {role!r} in this run (roles: {', '.join(roles)}).",
                "Pin states of the roles the run has.",
            )
        if state not in roles[role].states:
            raise ConfigError(
                "residency",
                f"{role}.{state}: a {roles[role].kind} has no state {state!r} "
                f"(it has {', '.join(roles[role].states)}).",
            )
        for move in (pinned,) if isinstance(pinned, str) else pinned:
            if move not in STATE_MOVES[state]:
                raise ConfigError(
                    "residency", f"{role}.{state}={move}: {state} can only be {', '.join(STATE_MOVES[state])}."
                )


__all__ = [
    "DEFAULT_USABLE",
    "MODES",
    "build_layout",
    "check_sleepers",
    "consistent",
    "plan_cost",
    "plan_residency",
    "sleep_move",
]
