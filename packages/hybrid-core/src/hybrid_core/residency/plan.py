"""A residency plan: for every phase of a step and every GPU, which state of which role is on the GPU.

It is built from one decision per (role, state) -- a move from :data:`~.steps.MOVES` -- and the memory model's
sizes, and it can say everything the loop and the user need: what is resident in each phase, the predicted peak
of each GPU in each phase against its capacity, how many bytes move per step, and the table a dry run prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import PlacementError
from .host import HostBudget, HostUse, check_host, host_dict, host_notes, host_use, render_host
from .memory import GiB, GpuShare
from .steps import Phase, absent_runs, needed_in

#: Moves that take a state off the GPU between the phases that need it.
MOVING = ("offload", "discard", "release")


def tracked(state: str) -> bool:
    """States followed even when the model gives them no bytes: an engine's KV cache goes wherever its weights go
    (the built-in engine builds its cache per call, so it has no standing bytes, but it still sleeps and wakes)."""
    return state == "kv_cache"


@dataclass
class ResidencyPlan:
    """What stays on each GPU in each phase. Build with :func:`~.planner.plan_residency` or :meth:`manual`."""

    mode: str
    phases: tuple[Phase, ...]
    moves: dict[tuple[str, str], str]  # (role, state) -> move
    layout: dict[int, tuple[GpuShare, ...]]  # plan GPU -> the roles on it
    gpu_bytes: float
    capacity: float  # bytes of estimates a phase may use on one GPU (gpu_bytes less the safety margin)
    notes: list[str] = field(default_factory=list)
    measured: dict[tuple[int, str], float] = field(default_factory=dict)  # (gpu, phase) -> bytes seen at run time
    #: gpu -> bytes a run measured beyond what the model counts (contexts, library buffers, fragmentation); added to
    #: every phase of that GPU (see hybrid_algos.train.loop's refinement after steps 1, 2, 4, 8, ...)
    overhead: dict[int, float] = field(default_factory=dict)
    #: the host memory each node may fill (see :mod:`.host`); None: not checked (a plan built without one)
    host: HostBudget | None = None

    # ---- what is where ---------------------------------------------------------------------------------------------
    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.role for shares in self.layout.values() for s in shares))

    def move(self, role: str, state: str) -> str:
        return self.moves.get((role, state), "resident")

    def present(self, role: str, state: str, phase: str) -> bool:
        """Whether ``state`` of ``role`` is on its GPUs during ``phase``."""
        move = self.move(role, state)
        if move == "host":
            return False
        if state == "cache":  # working memory inside the role's own phases; reserved after them unless trimmed
            return move == "resident" and not self._works_in(role, phase)
        return move == "resident" or phase in needed_in(self.phases, role, state)

    def resident_states(self, role: str, phase: str) -> tuple[str, ...]:
        return tuple(s for (r, s) in self._states(role) if self.present(r, s, phase))

    def sleeps(self, role: str) -> bool:
        """Whether the role moves any state during a step (it then takes turns on its GPUs)."""
        return any(self.move(r, s) in MOVING for r, s in self._states(role) if s != "cache")

    def engine_sleep_level(self, role: str) -> int | None:
        """The sleep level after generating of the engine role ``role``: 1 (weights to host), 2 (weights
        discarded), None (stays)."""
        return {"offload": 1, "discard": 2}.get(self.move(role, "weights"))

    # ---- memory ----------------------------------------------------------------------------------------------------
    def breakdown(self, gpu: int, phase: str) -> dict[tuple[str, str], float]:
        """(role, item) -> bytes on ``gpu`` in ``phase``: resident states, the working role's working memory,
        and every worker's CUDA context."""
        items: dict[tuple[str, str], float] = {}
        for share in self.layout[gpu]:
            size, n = share.size, share.workers
            for state, nbytes in size.states.items():
                if nbytes and self.present(size.role, state, phase):
                    items[(size.role, state)] = items.get((size.role, state), 0.0) + nbytes * n
            working = size.working.get(phase, {}) if self._works_in(size.role, phase) else {}
            for item, nbytes in working.items():
                if nbytes:
                    items[(size.role, item)] = items.get((size.role, item), 0.0) + nbytes * n
            if working and self.move(size.role, "cache") == "resident":
                # the allocator still holds the role's largest working set from its earlier phase (its cache)
                floor = size.states.get("cache", 0.0) - sum(working.values())
                if floor > 0:
                    items[(size.role, "cache")] = items.get((size.role, "cache"), 0.0) + floor * n
            items[(size.role, "context")] = items.get((size.role, "context"), 0.0) + size.context * n
        if self.overhead.get(gpu):
            items[("measured", "overhead")] = self.overhead[gpu]
        return items

    def peak(self, gpu: int, phase: str) -> float:
        """Predicted bytes on ``gpu`` at the height of ``phase``."""
        return sum(self.breakdown(gpu, phase).values())

    @property
    def usable(self) -> float:
        return self.capacity / self.gpu_bytes if self.gpu_bytes else 1.0

    def load(self, gpu: int, phase: str, extra: float = 0.0) -> float:
        """The peak as the capacity sees it: estimates at face value, exact pools (an engine's pre-allocated
        fraction of the GPU) scaled by the usable fraction, since the safety margin is for estimates only.
        ``extra``: estimated bytes to add (a state brought back early)."""
        exact = self._exact_bytes(gpu, phase)
        return self.peak(gpu, phase) - exact + exact * self.usable + extra

    def fits_phase(self, gpu: int, phase: str, extra: float = 0.0) -> bool:
        return self.load(gpu, phase, extra) <= self.capacity + 1.0

    def worst(self) -> tuple[int, str, float]:
        """(gpu, phase, bytes) of the fullest GPU in its fullest phase (fullest against its capacity)."""
        return max(
            ((g, p.name, self.peak(g, p.name)) for g in self.layout for p in self.phases),
            key=lambda t: self.load(t[0], t[1]),
            default=(0, "", 0.0),
        )

    def fits(self) -> bool:
        return all(self.fits_phase(g, p.name) for g in self.layout for p in self.phases)

    def check(self) -> None:
        """Raise a :class:`PlacementError` naming the GPU, the phase and the numbers when the plan does not fit --
        on a GPU, or in a node's host memory (:func:`.host.check_host`)."""
        gpu, phase, total = self.worst()
        if self.fits_phase(gpu, phase):
            check_host(self.host, self.host_use())
            return
        items = self.breakdown(gpu, phase)
        parts = ", ".join(
            f"{role} {item} {v / GiB:.1f}"
            for (role, item), v in sorted(items.items(), key=lambda kv: -kv[1])
            if v >= 0.05 * GiB
        )
        raise PlacementError(
            "residency",
            f"GPU {gpu}, phase {phase}: {total / GiB:.1f} GiB needed > {self.capacity / GiB:.1f} GiB "
            f"usable of {self.gpu_bytes / GiB:.1f} GiB ({parts} GiB).",
            _fix_for(self, items),
        )

    def _exact_bytes(self, gpu: int, phase: str) -> float:
        return sum(
            share.size.states[s] * share.workers
            for share in self.layout[gpu]
            for s in share.size.exact
            if self.present(share.role, s, phase)
        )

    def bytes_moved(self, gpu: int) -> float:
        """Bytes that cross PCIe on ``gpu`` per step (offloads and reloads; discards and releases move none)."""
        total = 0.0
        for share in self.layout[gpu]:
            for state, nbytes in share.size.states.items():
                if self.move(share.role, state) == "offload":
                    present = frozenset(p.name for p in self.phases if self.present(share.role, state, p.name))
                    total += 2 * nbytes * share.workers * absent_runs(self.phases, present)
        return total

    def host_use(self) -> dict[int, HostUse]:
        """Node -> what the plan keeps in its host memory (offloaded states, CPU Adam, the processes' estimate)."""
        return host_use(self.layout, self.moves, self.host.gpus_per_node if self.host else None)

    def all_notes(self) -> list[str]:
        """The plan's notes and what it says about host memory (computed, so a replanned copy says it afresh)."""
        return [*self.notes, *host_notes(self.host, self.host_use())]

    # ---- showing it ----------------------------------------------------------------------------------------------
    def describe_moves(self) -> list[str]:
        """One line per role: what leaves the GPU and how (or that everything stays)."""
        lines = []
        for role in self.roles:
            moving = [f"{s} {m}" for (r, s), m in self.moves.items() if r == role and m != "resident"]
            lines.append(f"{role}: " + (", ".join(moving) if moving else "everything resident"))
        return lines

    def render(self) -> str:
        """Per phase and per group of identical GPUs: what is resident, the predicted peak vs the capacity."""
        groups: dict[tuple[tuple[str, int], ...], list[int]] = {}
        for gpu, shares in self.layout.items():
            groups.setdefault(tuple((s.role, s.workers) for s in shares), []).append(gpu)
        lines = [f"residency ({self.mode}): " + "; ".join(self.describe_moves())]
        counted_shown = False
        for key, gpus in groups.items():
            gpu = gpus[0]
            lines.append(
                f"GPU {_span(gpus)} ({', '.join(r for r, _ in key)}), {self.gpu_bytes / GiB:.1f} GiB each, "
                f"usable {self.capacity / GiB:.1f}; moved per step {self.bytes_moved(gpu) / GiB:.2f} GiB"
            )
            for phase in self.phases:
                resident = []
                for share in self.layout[gpu]:
                    held = [s for s in self.resident_states(share.role, phase.name) if share.size.states.get(s)]
                    if held:
                        resident.append(f"{share.role}[{','.join(held)}]")
                peak = self.peak(gpu, phase.name)
                flag = "ok" if self.fits_phase(gpu, phase.name) else "OVER"
                # the verdict is on the load (exact pools without the margin), not the peak: shown where they differ
                counted = f"{self.load(gpu, phase.name) / GiB:.2f}"
                counted_text = f", counted {counted}" if counted != f"{peak / GiB:.2f}" else ""
                counted_shown = counted_shown or bool(counted_text)
                seen = self.measured.get((gpu, phase.name))
                seen_text = f", measured {seen / GiB:.2f}" if seen else ""
                lines.append(
                    f"  {phase.name:<13} peak {peak / GiB:7.2f} GiB{counted_text} {flag:<4}{seen_text}  "
                    f"resident: {' '.join(resident) or '-'}"
                )
        if counted_shown:
            lines.append(
                f"  counted: what the ok / OVER beside it is for, held against the usable "
                f"{self.capacity / GiB:.1f} GiB: the peak with the engines' pre-allocated pools (exact sizes) "
                f"at {self.usable:.0%}, as the safety margin is for estimates only"
            )
        lines.extend(render_host(self.host, self.host_use()))
        lines.extend(f"note: {n}" for n in self.all_notes())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "gpu_bytes": self.gpu_bytes,
            "capacity": self.capacity,
            "moves": {f"{r}.{s}": m for (r, s), m in self.moves.items()},
            "peaks": {str(g): {p.name: self.peak(g, p.name) for p in self.phases} for g in self.layout},
            "overhead": {str(g): v for g, v in self.overhead.items()},
            "bytes_moved_per_step": {str(g): self.bytes_moved(g) for g in self.layout},
            "host": host_dict(self.host, self.host_use()),
            "notes": self.all_notes(),
        }

    # ---- internals -----------------------------------------------------------------------------------------------
    def _states(self, role: str) -> list[tuple[str, str]]:
        for shares in self.layout.values():
            for share in shares:
                if share.role == role:
                    return [(role, s) for s, nbytes in share.size.states.items() if nbytes or tracked(s)]
        return []

    def _works_in(self, role: str, phase: str) -> bool:
        return any(p.name == phase and role in p.needs for p in self.phases)


def _fix_for(plan: ResidencyPlan, items: Mapping[tuple[str, str], float]) -> str:
    role, item = max(items, key=lambda k: items[k])
    if plan.mode == "auto":
        return {
            "optimizer": f"Use more GPUs for the {role} or trainer.zero_stage 3 across several GPUs (moving the "
            "optimizer state off the GPU between phases was not enough), or a bf16 optimizer state if not already "
            "(trainer.bf16_master_weights trainer.bf16_optimizer_states: 6 bytes per parameter instead of 12).",
            "activations": "Use trainer.gradient_checkpointing or a smaller micro batch size.",
            "logits": "Use a smaller micro batch size (logits are micro batch x length x vocabulary).",
            "kv_cache": "Lower engine.gpu_memory_utilization (the engine's pool).",
            "weights": "Use a larger engine.tensor_parallel_size, or more GPUs.",
        }.get(item, f"Give the roles more GPUs, or smaller models / batches ({role} {item} is the largest item).")
    return {
        "optimizer": f"Use residency.mode auto (the planner moves what does not fit), trainer.adam_offload, or more "
        f"GPUs for the {role}.",
        "kv_cache": "Lower engine.gpu_memory_utilization, or let the engines sleep (engine.sleep).",
        "weights": "Let colocated roles sleep (residency.trainer_sleep / engine.sleep), or residency.mode auto.",
    }.get(item, "Use residency.mode auto, give the roles more GPUs, or let colocated roles sleep.")


def _span(gpus: list[int]) -> str:
    from ..placement.ranges import format_gpus

    return format_gpus(gpus)
