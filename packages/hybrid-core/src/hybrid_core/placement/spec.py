"""What the user asked for: which GPUs each role uses, how wide its engines are, which roles sleep.

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
from typing import TYPE_CHECKING, Iterable, Mapping

from ..errors import PlacementError
from .checks import LIGHT_ROLES, cluster_size, require_int, role_set
from .counts import spec_from_counts
from .ranges import GpuRange, parse_gpu_range

if TYPE_CHECKING:
    from .plan import PlacementPlan


@dataclass(frozen=True)
class PlacementSpec:
    """Roles and their GPUs, before validation. Build it with :meth:`from_ranges` or :meth:`from_counts`.

    ``gpus``: role -> plan GPU indices (positions in the job's placement group, not physical ids).
    ``tp``: role -> GPUs per worker (tensor-parallel engines; default 1).
    ``sleep``: roles that offload to host memory while another role uses their GPUs.
    ``heavy``: roles that hold large memory (optimizer state, KV cache); on a shared GPU at most one heavy role may
    stay resident, the others must sleep.
    ``gpu_fields`` / ``tp_fields`` / ``sleep_fields``: the user-facing setting behind each role's GPUs, width and
    sleep, so errors name what to change. ``unshare_fix`` says how to give roles separate GPUs in this spec's terms.
    """

    gpus: Mapping[str, tuple[int, ...]]
    tp: Mapping[str, int] = field(default_factory=dict)
    sleep: frozenset[str] = frozenset()
    heavy: frozenset[str] = frozenset()
    cluster_gpus: int | None = None
    gpus_per_node: int | None = None
    gpu_fields: Mapping[str, str] = field(default_factory=dict)
    tp_fields: Mapping[str, str] = field(default_factory=dict)
    sleep_fields: Mapping[str, str] = field(default_factory=dict)
    unshare_fix: str = "give them disjoint GPU ranges"

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

    def sleep_field(self, role: str) -> str:
        return self.sleep_fields.get(role, "sleep")

    def tp_of(self, role: str) -> int:
        return self.tp.get(role, 1)

    # ---- constructors ------------------------------------------------------------------------------------------
    @classmethod
    def from_ranges(
        cls,
        ranges: Mapping[str, GpuRange],
        *,
        tp: Mapping[str, int] | None = None,
        sleep: Iterable[str] = (),
        heavy: Iterable[str] | None = None,
        cluster_gpus: int | None = None,
        gpus_per_node: int | None = None,
        num_nodes: int | None = None,
        field_prefix: str = "placement",
    ) -> PlacementSpec:
        """Per-role GPU ranges, RLinf-style: ``{"actor": "0-7", "env": "0-3", "rollout": "4-7"}``.

        Roles whose ranges overlap share those GPUs (that is how colocation is declared). ``tp`` gives a role's
        GPUs per worker (its ranges must split into consecutive groups of that size). ``sleep`` names the roles
        that offload while others run. ``heavy`` overrides which roles count as memory-heavy (default: all but
        ``reference`` and ``reward``). The cluster size is ``cluster_gpus`` or ``num_nodes x gpus_per_node``.
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
        sleep = frozenset(role_set(sleep, "sleep"))
        unknown = sorted(sleep - gpus.keys())
        if unknown:
            raise PlacementError("sleep", f"{unknown[0]!r} has no GPU range, so it cannot sleep.",
                                 f"Use one of the roles given: {', '.join(gpus)}.")
        if heavy is None:
            heavy_set = frozenset(gpus) - LIGHT_ROLES
        else:
            heavy_set = frozenset(role_set(heavy, "heavy"))
            unknown = sorted(heavy_set - gpus.keys())
            if unknown:
                raise PlacementError("heavy", f"{unknown[0]!r} has no GPU range.",
                                     f"Use one of the roles given: {', '.join(gpus)}.")
        cluster_gpus = cluster_size(cluster_gpus, gpus_per_node, num_nodes)
        return cls(
            gpus=gpus, tp=tp, sleep=sleep, heavy=heavy_set, cluster_gpus=cluster_gpus, gpus_per_node=gpus_per_node,
            gpu_fields={role: f"{field_prefix}.{role}" for role in gpus},
            tp_fields={role: f"tp.{role}" for role in gpus},
            sleep_fields={role: "sleep" for role in gpus},
            unshare_fix=f"give them disjoint ranges in {field_prefix}",
        )

    #: OpenRLHF-style counts and flags (``actor_num_nodes=1, ..., colocate_all_models=True``); see
    #: :func:`hybrid_core.placement.counts.spec_from_counts` for the rules.
    from_counts = staticmethod(spec_from_counts)
