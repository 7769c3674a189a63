"""What the user asked for: which GPUs each role uses and how wide its engines are.

(What each role keeps on its GPUs between phases is not placement: see :mod:`hybrid_core.residency`.)

Two ways to write it, one result:

* RLinf-style ranges, any role names: ``PlacementSpec.from_ranges({"actor": "0-7", "rollout": "4-7"}, ...)``.
  Overlapping ranges *are* the declaration that those roles share GPUs (as in RLinf's hybrid mode).
* Counts (nodes x GPUs per node, engines x tensor-parallel size), each role on its own block or on another role's
  GPUs: ``PlacementSpec.from_counts([CountedRole(...), ...])`` (see :mod:`hybrid_core.placement.counts`; the
  training loop builds the roles from OpenRLHF's flags).

Each constructor checks its own fields (syntax, signs); :meth:`PlacementSpec.plan` checks how they fit together
and lays them out as a :class:`~.plan.PlacementPlan` (one worker per ``tp`` GPUs, equal fractions of each shared GPU).
Neither needs Ray: every error is raised before anything is scheduled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import PlacementError
from .checks import cluster_size, require_int
from .counts import CountedRole, spec_fields_from_counts
from .plan import PlacementPlan, RolePlacement, WorkerSlot
from .ranges import GpuRange, describe_gpus, format_gpus, parse_gpu_range

#: Ray accounts resources in steps of 1e-4; fractions are rounded down to that so they never sum above 1.
_RAY_RESOURCE_STEP = 10_000


@dataclass(frozen=True)
class PlacementSpec:
    """Roles and their GPUs, before validation. Build it with :meth:`from_ranges` or :meth:`from_counts`.

    ``gpus``: role -> plan GPU indices (positions in the job's placement group, not physical ids).
    ``tp``: role -> GPUs per worker (tensor-parallel engines; default 1).
    ``gpu_fields`` / ``tp_fields``: the user-facing setting behind each role's GPUs and width, so errors name what
    to change.
    """

    gpus: Mapping[str, tuple[int, ...]]
    tp: Mapping[str, int] = field(default_factory=dict)
    cluster_gpus: int | None = None
    gpus_per_node: int | None = None
    gpu_fields: Mapping[str, str] = field(default_factory=dict)
    tp_fields: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Direct construction gets the same GPU-list checks as from_ranges (sorted, no repeats, no negatives).
        normalised = {role: parse_gpu_range(list(gpus), self.gpu_field(role)) for role, gpus in self.gpus.items()}
        object.__setattr__(self, "gpus", normalised)

    def plan(self) -> PlacementPlan:
        """Validate and lay out the spec; raises :class:`~hybrid_core.errors.PlacementError` naming the field."""
        return build_plan(self)

    def gpu_field(self, role: str) -> str:
        return self.gpu_fields.get(role, f"placement.{role}")

    def tp_field(self, role: str) -> str:
        return self.tp_fields.get(role, f"tp.{role}")

    def tp_of(self, role: str) -> int:
        return self.tp.get(role, 1)

    # ---- constructors ------------------------------------------------------------------------------------------
    @classmethod
    def from_ranges(
        cls,
        ranges: Mapping[str, GpuRange],
        *,
        tp: Mapping[str, int] | None = None,
        cluster_gpus: int | None = None,
        gpus_per_node: int | None = None,
        num_nodes: int | None = None,
        field_prefix: str = "placement",
    ) -> PlacementSpec:
        """Per-role GPU ranges, RLinf-style: ``{"actor": "0-7", "env": "0-3", "rollout": "4-7"}``.

        Roles whose ranges overlap share those GPUs (that is how colocation is declared). ``tp`` gives a role's
        GPUs per worker (its ranges must split into consecutive groups of that size). The cluster size is
        ``cluster_gpus`` or ``num_nodes x gpus_per_node``.
        ``field_prefix`` is how errors spell a role's setting (``placement.actor``).
        """
        if not isinstance(ranges, Mapping) or not ranges:
            raise PlacementError(
                field_prefix, "no roles given.", "Give each role a GPU range, e.g. {'actor': '0-7', 'rollout': '0-7'}."
            )
        gpus: dict[str, tuple[int, ...]] = {}
        for role, value in ranges.items():
            if not isinstance(role, str) or not role.strip():
                raise PlacementError(
                    field_prefix,
                    f"role names must be non-empty strings, got {role!r}.",
                    "Name each role, e.g. {'actor': '0-7'}.",
                )
            gpus[role] = parse_gpu_range(value, f"{field_prefix}.{role}")
        tp = dict(tp or {})
        for role, size in tp.items():
            if role not in gpus:
                raise PlacementError(
                    f"tp.{role}", f"{role!r} has no GPU range.", f"Use one of the roles given: {', '.join(gpus)}."
                )
            require_int(size, f"tp.{role}", minimum=1)
        cluster_gpus = cluster_size(cluster_gpus, gpus_per_node, num_nodes)
        return cls(
            gpus=gpus,
            tp=tp,
            cluster_gpus=cluster_gpus,
            gpus_per_node=gpus_per_node,
            gpu_fields={role: f"{field_prefix}.{role}" for role in gpus},
            tp_fields={role: f"tp.{role}" for role in gpus},
        )

    @classmethod
    def from_counts(cls, roles: Sequence[CountedRole], **cluster: Any) -> PlacementSpec:
        """Roles by counts, in order (``cluster``: ``gpus_per_node``, ``cluster_gpus``, ``num_nodes``); see
        :func:`hybrid_core.placement.counts.spec_fields_from_counts` for the rules."""
        return cls(**spec_fields_from_counts(roles, **cluster))


# ---- the layout ------------------------------------------------------------------------------------------------
def build_plan(spec: PlacementSpec) -> PlacementPlan:
    """Check the spec as a whole and lay it out (:meth:`PlacementSpec.plan`); every failure is a
    :class:`PlacementError` naming the field. Each GPU's roles ask Ray for equal fractions of it (see
    :mod:`.plan` for why equal)."""
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
        workers = [
            WorkerSlot(rank, chunk, min(_fraction(len(residents[g])) for g in chunk))
            for rank, chunk in enumerate(role_chunks)
        ]
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
                "or run on a cluster with more GPUs.",
            )


def _check_no_idle_gpus(spec: PlacementSpec, num_gpus: int) -> None:
    # The placement group reserves GPUs 0..num_gpus-1; a gap would be reserved and never used.
    used = {g for gpus in spec.gpus.values() for g in gpus}
    idle = sorted(set(range(num_gpus)) - used)
    if idle:
        fields = ", ".join(dict.fromkeys(spec.gpu_field(r) for r in spec.gpus))
        raise PlacementError(
            fields,
            f"no role uses {describe_gpus(idle)}, but the placement group would "
            f"reserve GPUs 0-{num_gpus - 1} and leave it idle.",
            "Number the GPUs from 0 without gaps: plan GPUs are positions in the job's placement "
            "group, not physical device ids.",
        )


def _engine_chunks(spec: PlacementSpec, role: str) -> list[tuple[int, ...]]:
    """Split a role's GPUs into its workers: groups of ``tp`` consecutive GPUs on one node."""
    gpus, tp = spec.gpus[role], spec.tp_of(role)
    field = spec.tp_field(role)
    if len(gpus) % tp:
        raise PlacementError(
            field,
            f"{role} has {len(gpus)} GPUs ({format_gpus(gpus)}), which do not split into "
            f"engines of tensor-parallel size {tp}.",
            f"Give {role} a multiple of {tp} GPUs ({spec.gpu_field(role)}), or a tensor-parallel "
            f"size that divides {len(gpus)}.",
        )
    if spec.gpus_per_node is not None and tp > spec.gpus_per_node:
        raise PlacementError(
            field,
            f"an engine of {tp} GPUs does not fit on a node of {spec.gpus_per_node} GPUs.",
            f"Use a tensor-parallel size of at most {spec.gpus_per_node}.",
        )
    chunks = [gpus[i : i + tp] for i in range(0, len(gpus), tp)]
    for rank, chunk in enumerate(chunks):
        if chunk[-1] - chunk[0] != tp - 1:
            raise PlacementError(
                field,
                f"{role} engine {rank} would get {describe_gpus(chunk)}, which are not "
                "consecutive (a tensor-parallel engine needs neighbouring GPUs).",
                f"Give {role} ranges made of consecutive runs of {tp} GPUs ({spec.gpu_field(role)}).",
            )
        if spec.gpus_per_node and chunk[0] // spec.gpus_per_node != chunk[-1] // spec.gpus_per_node:
            raise PlacementError(
                field,
                f"{role} engine {rank} would span {describe_gpus(chunk)}, across a node "
                f"boundary (nodes of {spec.gpus_per_node} GPUs).",
                f"Start {role}'s GPUs ({spec.gpu_field(role)}) at a multiple of {tp} within a node.",
            )
    return chunks
