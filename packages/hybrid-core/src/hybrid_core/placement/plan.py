"""The validated layout: for each role its workers, and each worker's GPU(s) and GPU fraction.

One Ray bundle per GPU (see :mod:`.ray_groups`), so a worker is pinned to a GPU by its bundle index and the
fraction it asks for only has to let the roles sharing that GPU fit in its bundle: the fractions on every GPU sum
to at most 1. (OpenRLHF's 0.75/0.25 trick was needed because its ranks were not pinned to bundles: with 0.5 Ray
packed two ranks of one role onto the same GPU. Pinning makes the split irrelevant, so it is simply equal.)
Fractions are Ray bookkeeping, not memory limits: what each role keeps on a shared GPU in each phase is decided by
the residency plan (:mod:`hybrid_core.residency`).

:meth:`PlacementPlan.render` is the plan as plain text: a GPU x role table and a per-role summary (the body of
a dry run). Example (OpenRLHF's 8-GPU hybrid engine)::

    placement: 8 GPUs on 1 node (8 GPUs per node)

    GPU | actor   | rollout  | reference | reward
    ----+---------+----------+-----------+--------
      0 | #0 0.25 | #0 0.25  | #0 0.25   | #0 0.25
    ...
    cell: worker rank and the fraction of the GPU it asks Ray for (bookkeeping, not a memory limit)

What each role keeps on its GPUs phase by phase is the residency plan's table (:mod:`hybrid_core.residency`).
The plan is built, and checked, by :meth:`PlacementSpec.plan <hybrid_core.placement.PlacementSpec.plan>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .ranges import describe_gpus, format_gpus

#: What a table cell shows where a role has no worker on the GPU.
EMPTY_CELL = "-"


@dataclass(frozen=True)
class WorkerSlot:
    """One worker of a role: its rank, its plan GPU(s) (consecutive; >1 for a tensor-parallel engine) and the
    fraction of each of those GPUs it asks Ray for."""

    rank: int
    gpus: tuple[int, ...]
    num_gpus: float


@dataclass(frozen=True)
class RolePlacement:
    """Where one role runs. ``tp`` is GPUs per worker."""

    role: str
    workers: list[WorkerSlot]
    tp: int = 1

    @property
    def gpus(self) -> tuple[int, ...]:
        """All plan GPUs of this role, sorted."""
        return tuple(sorted({g for w in self.workers for g in w.gpus}))

    @property
    def world_size(self) -> int:
        return len(self.workers)


@dataclass(frozen=True)
class PlacementPlan:
    """The whole layout. GPU ``k`` is the k-th GPU of the job's placement group (ordered by node, then device id,
    once placed), not a physical id."""

    num_gpus: int
    roles: dict[str, RolePlacement]
    gpus_per_node: int | None = None

    def roles_on_gpu(self, gpu: int) -> list[str]:
        """The roles with a worker on plan GPU ``gpu``, in plan order."""
        self._check_gpu(gpu)
        return [name for name, role in self.roles.items() if any(gpu in w.gpus for w in role.workers)]

    def worker_on_gpu(self, role: str, gpu: int) -> WorkerSlot | None:
        """The worker of ``role`` that uses ``gpu`` (None if the role does not use it)."""
        self._check_gpu(gpu)
        return next((w for w in self.roles[role].workers if gpu in w.gpus), None)

    def shared_gpus(self, role: str) -> tuple[int, ...]:
        """The role's GPUs that another role also uses."""
        return tuple(g for g in self.roles[role].gpus if len(self.roles_on_gpu(g)) > 1)

    def node_of(self, gpu: int) -> int:
        """The node index of a plan GPU (0 when the node size is unknown)."""
        return gpu // self.gpus_per_node if self.gpus_per_node else 0

    def render(self) -> str:
        """The plan as a text table: one row per GPU, one column per role (worker rank and GPU fraction), its legend
        and the role summary, as one string (no trailing newline)."""
        lines = [_title(self), ""]
        lines += _gpu_table(self)
        lines.append("cell: worker rank and the fraction of the GPU it asks Ray for (bookkeeping, not a memory limit)")
        lines.append("")
        lines += _role_summary(self)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (for logs and a dry run's JSON)."""
        return {
            "num_gpus": self.num_gpus,
            "gpus_per_node": self.gpus_per_node,
            "roles": {
                name: {
                    "tp": r.tp,
                    "workers": [{"rank": w.rank, "gpus": list(w.gpus), "num_gpus": w.num_gpus} for w in r.workers],
                }
                for name, r in self.roles.items()
            },
        }

    def _check_gpu(self, gpu: int) -> None:
        if not 0 <= gpu < self.num_gpus:
            raise IndexError(f"plan GPU {gpu} is outside 0-{self.num_gpus - 1}")


# ---- the text form -------------------------------------------------------------------------------------------
def _title(plan: PlacementPlan) -> str:
    if plan.gpus_per_node:
        nodes = -(-plan.num_gpus // plan.gpus_per_node)
        where = f"on {nodes} node{'s' if nodes > 1 else ''} ({plan.gpus_per_node} GPUs per node)"
    else:
        where = "(node size not given)"
    return f"placement: {plan.num_gpus} GPU{'s' if plan.num_gpus > 1 else ''} {where}"


def _gpu_table(plan: PlacementPlan) -> list[str]:
    headers = ["GPU", *plan.roles]
    rows: list[list[str]] = []
    for gpu in range(plan.num_gpus):
        row = [str(gpu)]
        for name in plan.roles:
            worker = plan.worker_on_gpu(name, gpu)
            row.append(EMPTY_CELL if worker is None else f"#{worker.rank} {_fmt_fraction(worker.num_gpus)}")
        rows.append(row)
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = cells[0].rjust(widths[0])
        rest = [c.ljust(w) for c, w in zip(cells[1:], widths[1:])]
        return " | ".join([first, *rest]).rstrip()

    out = [line(headers), "-+-".join("-" * w for w in widths)]
    for gpu, row in enumerate(rows):
        if plan.gpus_per_node and gpu % plan.gpus_per_node == 0 and plan.num_gpus > plan.gpus_per_node:
            last = min(gpu + plan.gpus_per_node, plan.num_gpus) - 1
            out.append(f"{'':>{widths[0]}} | node {plan.node_of(gpu)} (GPUs {gpu}-{last})")
        out.append(line(row))
    return out


def _role_summary(plan: PlacementPlan) -> list[str]:
    headers = ["role", "workers", "tp", "GPUs", "fraction", "shares"]
    rows = [
        [name, str(role.world_size), str(role.tp), format_gpus(role.gpus), _fraction_span(role), _sharing(plan, name)]
        for name, role in plan.roles.items()
    ]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers, *rows]]


def _sharing(plan: PlacementPlan, name: str) -> str:
    shared = plan.shared_gpus(name)
    return describe_gpus(shared) if shared else "-"


def _fraction_span(role: RolePlacement) -> str:
    fractions = sorted({w.num_gpus for w in role.workers})
    if len(fractions) == 1:
        return _fmt_fraction(fractions[0])
    return f"{_fmt_fraction(fractions[0])}-{_fmt_fraction(fractions[-1])}"


def _fmt_fraction(value: float) -> str:
    return "1" if value >= 1 else f"{value:.4f}".rstrip("0")
