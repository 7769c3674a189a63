"""The validated layout: for each role its workers, and each worker's GPU(s) and GPU fraction.

One Ray bundle per GPU (see :mod:`.ray_groups`), so a worker is pinned to a GPU by its bundle index and the
fraction it asks for only has to let the roles sharing that GPU fit in its bundle: the fractions on every GPU sum
to at most 1. (OpenRLHF's 0.75/0.25 trick was needed because its ranks were not pinned to bundles: with 0.5 Ray
packed two ranks of one role onto the same GPU. Pinning makes the split irrelevant, so it is simply equal.)
Fractions are Ray bookkeeping, not memory limits: what each role keeps on a shared GPU in each phase is decided by
the residency plan (:mod:`hybrid_core.residency`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import PlacementError
from .ranges import describe_gpus, format_gpus

if TYPE_CHECKING:
    from .spec import PlacementSpec

#: Ray accounts resources in steps of 1e-4; fractions are rounded down to that so they never sum above 1.
_RAY_RESOURCE_STEP = 10_000


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
        """The plan as a text table: one row per GPU, one column per role (worker rank and GPU fraction)."""
        from .render import render_plan

        return render_plan(self)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (for logs and ``--dry-run --json``)."""
        return {
            "num_gpus": self.num_gpus,
            "gpus_per_node": self.gpus_per_node,
            "roles": {
                name: {"tp": r.tp,
                       "workers": [{"rank": w.rank, "gpus": list(w.gpus), "num_gpus": w.num_gpus} for w in r.workers]}
                for name, r in self.roles.items()
            },
        }

    def _check_gpu(self, gpu: int) -> None:
        if not 0 <= gpu < self.num_gpus:
            raise IndexError(f"plan GPU {gpu} is outside 0-{self.num_gpus - 1}")


def build_plan(spec: PlacementSpec) -> PlacementPlan:
    """Check the spec as a whole and lay it out; every failure is a :class:`PlacementError` naming the field."""
    if not spec.gpus:
        raise PlacementError("placement", "no roles given.", "Give each role its GPUs.")
    num_gpus = max(max(gpus) for gpus in spec.gpus.values()) + 1
    _check_cluster(spec, num_gpus)
    _check_no_idle_gpus(spec, num_gpus)
    chunks = {role: _engine_chunks(spec, role) for role in spec.gpus}
    residents: dict[int, list[str]] = {g: [] for g in range(num_gpus)}
    for role, gpus in spec.gpus.items():
        for g in gpus:
            residents[g].append(role)

    roles: dict[str, RolePlacement] = {}
    for role, role_chunks in chunks.items():
        workers = [WorkerSlot(rank, chunk, min(_fraction(len(residents[g])) for g in chunk))
                   for rank, chunk in enumerate(role_chunks)]
        roles[role] = RolePlacement(role=role, workers=workers, tp=spec.tp_of(role))
    return PlacementPlan(num_gpus=num_gpus, roles=roles, gpus_per_node=spec.gpus_per_node)


def _fraction(sharers: int) -> float:
    return math.floor(_RAY_RESOURCE_STEP / sharers) / _RAY_RESOURCE_STEP


def _check_cluster(spec: PlacementSpec, num_gpus: int) -> None:
    if spec.cluster_gpus is None or num_gpus <= spec.cluster_gpus:
        return
    needed = ", ".join(f"{role} {format_gpus(gpus)}" for role, gpus in spec.gpus.items())
    for role, gpus in spec.gpus.items():
        outside = [g for g in gpus if g >= spec.cluster_gpus]
        if outside:
            raise PlacementError(
                spec.gpu_field(role),
                f"{role} would use {describe_gpus(outside)}, outside the cluster's {spec.cluster_gpus} GPUs "
                f"(0-{spec.cluster_gpus - 1}); the plan needs {num_gpus} GPUs ({needed}).",
                f"Fit every role into GPUs 0-{spec.cluster_gpus - 1} (share GPUs between roles, or give them fewer), "
                "or run on a cluster with more GPUs.")


def _check_no_idle_gpus(spec: PlacementSpec, num_gpus: int) -> None:
    # The placement group reserves GPUs 0..num_gpus-1; a gap would be reserved and never used.
    used = {g for gpus in spec.gpus.values() for g in gpus}
    idle = sorted(set(range(num_gpus)) - used)
    if idle:
        fields = ", ".join(dict.fromkeys(spec.gpu_field(r) for r in spec.gpus))
        raise PlacementError(fields, f"no role uses {describe_gpus(idle)}, but the placement group would "
                             f"reserve GPUs 0-{num_gpus - 1} and leave it idle.",
                             "Number the GPUs from 0 without gaps: plan GPUs are positions in the job's placement "
                             "group, not physical device ids.")


def _engine_chunks(spec: PlacementSpec, role: str) -> list[tuple[int, ...]]:
    """Split a role's GPUs into its workers: groups of ``tp`` consecutive GPUs on one node."""
    gpus, tp = spec.gpus[role], spec.tp_of(role)
    field = spec.tp_field(role)
    if len(gpus) % tp:
        raise PlacementError(field, f"{role} has {len(gpus)} GPUs ({format_gpus(gpus)}), which do not split into "
                             f"engines of tensor-parallel size {tp}.",
                             f"Give {role} a multiple of {tp} GPUs ({spec.gpu_field(role)}), or a tensor-parallel "
                             f"size that divides {len(gpus)}.")
    if spec.gpus_per_node is not None and tp > spec.gpus_per_node:
        raise PlacementError(field, f"an engine of {tp} GPUs does not fit on a node of {spec.gpus_per_node} GPUs.",
                             f"Use a tensor-parallel size of at most {spec.gpus_per_node}.")
    chunks = [gpus[i:i + tp] for i in range(0, len(gpus), tp)]
    for rank, chunk in enumerate(chunks):
        if chunk[-1] - chunk[0] != tp - 1:
            raise PlacementError(field, f"{role} engine {rank} would get {describe_gpus(chunk)}, which are not "
                                 "consecutive (a tensor-parallel engine needs neighbouring GPUs).",
                                 f"Give {role} ranges made of consecutive runs of {tp} GPUs ({spec.gpu_field(role)}).")
        if spec.gpus_per_node and chunk[0] // spec.gpus_per_node != chunk[-1] // spec.gpus_per_node:
            raise PlacementError(field, f"{role} engine {rank} would span {describe_gpus(chunk)}, across a node "
                                 f"boundary (nodes of {spec.gpus_per_node} GPUs).",
                                 f"Start {role}'s GPUs ({spec.gpu_field(role)}) at a multiple of {tp} within a node.")
    return chunks
