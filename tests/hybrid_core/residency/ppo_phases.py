"""PPO's step as the residency planner takes it: the phases and role kinds of the PPO recipe
(hybrid_algos.train.recipes), so the planner's and the memory model's tests plan the step a run plans -- core itself
names no algorithm's roles or phases (tests/hybrid_core/residency/test_recipe_inputs.py plans a made-up one).

``plan_residency``, ``size_role`` and ``build_layout`` here are core's, with PPO's phases (and kinds) passed in."""

from hybrid_algos.train.recipes import PPO
from hybrid_core.residency import build_layout as core_build_layout
from hybrid_core.residency import plan_residency as core_plan_residency
from hybrid_core.residency import size_role as core_size_role

#: every phase of PPO's step, in order (the planner skips those whose working role a layout does not have), as a run
#: without an evaluation dataset has them (the optional ``eval`` phase exists only with one)
PHASES = tuple(p.residency_phase() for p in PPO.phases if p.when is None)
KINDS = PPO.kinds


def plan_residency(layout, gpu_bytes, **kw):
    return core_plan_residency(layout, gpu_bytes, **{"phases": PHASES, **kw})


def size_role(role, shape, work, **kw):
    return core_size_role(role, shape, work, **{"kind": KINDS[role], "phases": PHASES, **kw})


def build_layout(placement, shapes, work, gpu_bytes):
    return core_build_layout(placement, shapes, work, gpu_bytes, kinds=KINDS, phases=PHASES)
