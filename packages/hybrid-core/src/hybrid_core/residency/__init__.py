"""Residency: what each role keeps on each GPU in each phase of a step, decided once from a memory budget and
carried out by one owner.

    layout = build_layout(placement_plan, model_shapes, Workload(...), gpu_bytes,  # the memory model
                          kinds={"actor": "trainer", ...}, phases=step)
    plan = plan_residency(layout, gpu_bytes, phases=step, mode="auto")             # the planner
    print(plan.render())                                                           # per phase: resident, peak
    owner = ResidencyOwner(plan, handles, turnstile=ts, guard=guard)               # every sleep/wake goes here
    owner.enter("generate"); ...; owner.enter("reward"); ...

:mod:`.steps` names the states, moves and kinds of work, and :class:`Phase` (the step is the caller's data: its
phases in order, e.g. ``hybrid_algos.train.recipes``' PPO, GRPO and REINFORCE++); :mod:`.memory` sizes them;
:mod:`.planner` chooses; :mod:`.plan` describes the choice (and :mod:`.host` what it keeps in each node's host memory);
:mod:`.owner` executes it, guarded by :mod:`.wake_guard`. :mod:`.refine` makes the plan again from what the GPUs
really hold after the first steps of a run.
"""

from .host import PROCESS_BYTES, HostBudget, HostUse, host_use, local_budget
from .memory import GiB, GpuShare, ModelShape, RoleSize, Workload, model_shape, size_role
from .owner import ResidencyOwner, RoleHandle
from .plan import ResidencyPlan
from .planner import DEFAULT_USABLE, MODES, build_layout, plan_residency, sleep_move
from .refine import Refinement, refine_plan
from .steps import KIND_STATES, MOVES, STATE_MOVES, WORK_KINDS, Phase, present_phases
from .wake_guard import WakeGuard

__all__ = [
    "DEFAULT_USABLE",
    "KIND_STATES",
    "MODES",
    "MOVES",
    "PROCESS_BYTES",
    "STATE_MOVES",
    "WORK_KINDS",
    "GiB",
    "GpuShare",
    "HostBudget",
    "HostUse",
    "ModelShape",
    "Phase",
    "Refinement",
    "ResidencyOwner",
    "ResidencyPlan",
    "RoleHandle",
    "RoleSize",
    "WakeGuard",
    "Workload",
    "build_layout",
    "host_use",
    "local_budget",
    "model_shape",
    "plan_residency",
    "present_phases",
    "refine_plan",
    "size_role",
    "sleep_move",
]
