"""Where each role runs: a placement spec (RLinf ranges or OpenRLHF counts) -> a validated plan -> a Ray
placement group with one bundle per GPU.

    spec = PlacementSpec.from_ranges({"actor": "0-7", "rollout": "0-7"})
    plan = spec.plan()          # validated without Ray; PlacementError names the field and the fix
    print(plan.render())        # GPU x role table
    placed = place(plan)        # one placement group, PACK, one {"GPU": 1, "CPU": c} bundle per GPU
    Worker.options(**placed.actor_options("actor", rank)).remote(...)
"""

from .counts import CountedRole
from .plan import PlacementPlan, RolePlacement, WorkerSlot
from .ranges import format_gpus, parse_gpu_range
from .ray_groups import PlacedPlan, place
from .spec import PlacementSpec

__all__ = [
    "CountedRole",
    "PlacedPlan",
    "PlacementPlan",
    "PlacementSpec",
    "RolePlacement",
    "WorkerSlot",
    "format_gpus",
    "parse_gpu_range",
    "place",
]
