"""What the user asked for: which GPUs each role uses and how wide its engines are.

(What each role keeps on its GPUs between phases is not placement: see :mod:`hybrid_core.residency`.)

Two ways to write it, one result:

* RLinf-style ranges, any role names: ``PlacementSpec.from_ranges({"actor": "0-7", "rollout": "4-7"}, ...)``.
  Overlapping ranges *are* the declaration that those roles share GPUs (as in RLinf's hybrid mode).
* OpenRLHF-style counts and colocation flags: ``PlacementSpec.from_counts(actor_num_nodes=1, ...)``
  (see :mod:`hybrid_core.placement.counts`).

Each constructor checks its own fields (syntax, signs); :meth:`PlacementSpec.plan` checks how they fit together.
Neither needs Ray: every error is raised before anything is scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ..errors import PlacementError
from .checks import cluster_size, require_int
from .counts import spec_from_counts
from .ranges import GpuRange, parse_gpu_range

if TYPE_CHECKING:
    from .plan import PlacementPlan


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
        from .plan import build_plan

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
            raise PlacementError(field_prefix, "no roles given.",
                                 "Give each role a GPU range, e.g. {'actor': '0-7', 'rollout': '0-7'}.")
        gpus: dict[str, tuple[int, ...]] = {}
        for role, value in ranges.items():
            if not isinstance(role, str) or not role.strip():
                raise PlacementError(field_prefix, f"role names must be non-empty strings, got {role!r}.",
                                     "Name each role, e.g. {'actor': '0-7'}.")
            gpus[role] = parse_gpu_range(value, f"{field_prefix}.{role}")
        tp = dict(tp or {})
        for role, size in tp.items():
            if role not in gpus:
                raise PlacementError(f"tp.{role}", f"{role!r} has no GPU range.",
                                     f"Use one of the roles given: {', '.join(gpus)}.")
            require_int(size, f"tp.{role}", minimum=1)
        cluster_gpus = cluster_size(cluster_gpus, gpus_per_node, num_nodes)
        return cls(
            gpus=gpus, tp=tp, cluster_gpus=cluster_gpus, gpus_per_node=gpus_per_node,
            gpu_fields={role: f"{field_prefix}.{role}" for role in gpus},
            tp_fields={role: f"tp.{role}" for role in gpus},
        )

    #: OpenRLHF-style counts and flags (``actor_num_nodes=1, ..., colocate_all_models=True``); see
    #: :func:`hybrid_core.placement.counts.spec_from_counts` for the rules.
    from_counts = staticmethod(spec_from_counts)
