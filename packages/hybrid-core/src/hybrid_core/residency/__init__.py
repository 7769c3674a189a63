"""Residency: what each role keeps on each GPU in each phase of a step, decided once from a memory budget and
carried out by one owner.

    layout = build_layout(placement_plan, model_shapes, Workload(...), gpu_bytes)   # the memory model
    plan = plan_residency(layout, gpu_bytes, mode="auto")                          # the planner
    print(plan.render())                                                           # per phase: resident, peak
    owner = ResidencyOwner(plan, handles, turnstile=ts, guard=guard)               # every sleep/wake goes here
    owner.enter("generate"); ...; owner.enter("reward"); ...

:mod:`.steps` names the states, moves and phases; :mod:`.memory` sizes them; :mod:`.planner` chooses;
:mod:`.plan` describes the choice (and :mod:`.host` what it keeps in each node's host memory); :mod:`.owner` executes it, guarded by :mod:`.wake_guard`.
:mod:`.refine` makes the plan again from what the GPUs really hold after the first steps of a run.
"""

from .host import PROCESS_BYTES, HostBudget, HostUse, host_use, local_budget
from .memory import GiB, ModelShape, RoleSize, Workload, model_shape, size_role
from .owner import ResidencyOwner, RoleHandle
from .plan import GpuShare, ResidencyPlan
from .planner import DEFAULT_USABLE, MODES, build_layout, plan_residency, sleep_move
from .refine import Refinement, refine_plan
from .steps import KIND_STATES, MOVES, STATE_MOVES, STEP, Phase, step_phases
from .wake_guard import WakeGuard

__all__ = [
    "DEFAULT_USABLE", "GiB", "GpuShare", "HostBudget", "HostUse", "KIND_STATES", "MODES", "MOVES", "ModelShape",
    "PROCESS_BYTES", "Phase", "Refinement", "ResidencyOwner", "ResidencyPlan", "RoleHandle", "RoleSize", "STATE_MOVES",
    "STEP", "WakeGuard", "Workload", "build_layout", "host_use", "local_budget", "model_shape", "plan_residency",
    "refine_plan", "size_role", "sleep_move", "step_phases",
]
