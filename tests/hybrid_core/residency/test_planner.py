"""The planner as a pure function: it never plans above capacity, moves nothing when everything fits, keeps
pinned and lonely roles resident, and finds the cheapest plan (checked against every alternative)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ppo_phases import PHASES, plan_residency

from hybrid_core.errors import ConfigError, PlacementError
from hybrid_core.residency import GiB, GpuShare, ResidencyPlan, RoleSize, present_phases
from hybrid_core.residency.planner import consistent, plan_cost
from hybrid_core.residency.steps import STATE_MOVES

ROLE_STATES = {
    "actor": ("params", "grads", "optimizer", "cache"),
    "reference": ("params", "cache"),
    "rollout": ("weights", "kv_cache"),
    "critic": ("params", "grads", "optimizer", "cache"),
}
KIND = {"actor": "trainer", "critic": "trainer", "reference": "frozen", "rollout": "engine"}
WORKS_IN = {
    "actor": ("actor_train", "sync"),
    "critic": ("critic_infer", "critic_train"),
    "reference": ("reference",),
    "rollout": ("generate", "sync"),
}


def role(name, gib, working_gib=0.5, context_gib=0.0):
    states = dict(zip(ROLE_STATES[name], gib))
    working = {phase: {"activations": working_gib * GiB} for phase in WORKS_IN[name]}
    size = RoleSize(name, KIND[name], {k: v * GiB for k, v in states.items()}, working, context_gib * GiB)
    if "cache" in ROLE_STATES[name]:
        size.states["cache"] = size.peak_working
    return size


def one_gpu(*sizes):
    return {0: tuple(GpuShare(s) for s in sizes)}


def colocated():
    """One GPU: actor 2 + 2 + 12 GiB, a reference of 2 GiB, an engine of 2 GiB weights + 20 GiB KV cache."""
    return one_gpu(role("actor", (2, 2, 12)), role("reference", (2,)), role("rollout", (2, 20)))


def test_everything_resident_when_it_fits():
    plan = plan_residency(colocated(), 80 * GiB)
    assert set(plan.moves.values()) == {"resident"} and plan.fits()
    assert plan.bytes_moved(0) == 0 and not any(plan.sleeps(r) for r in plan.roles)


def test_the_kv_cache_goes_first_then_the_optimizer():
    # generate: actor 16 + reference 2 + engine 22 + 0.5 working (+ 1 GiB of caches) = 40.5 (41.5);
    # actor_train: actor 16 + 0.5 working + reference 2 (+ 0.5 cache) + engine 22 = 41 with the KV cache resident
    kv_only = plan_residency(colocated(), 40.6 * GiB, usable=1.0)
    assert kv_only.fits() and kv_only.move("rollout", "kv_cache") == "release"
    assert not any(m == "offload" for m in kv_only.moves.values())  # nothing crosses PCIe
    assert kv_only.bytes_moved(0) == 0
    # 30 GiB: generate cannot hold the actor's 16 GiB beside the engine's 22: its optimizer (12) leaves, nothing else
    tighter = plan_residency(colocated(), 30 * GiB, usable=1.0)
    assert tighter.fits() and tighter.move("actor", "optimizer") == "offload"
    assert tighter.move("actor", "params") == tighter.move("actor", "grads") == "resident"
    assert tighter.bytes_moved(0) == 2 * 12 * GiB


def test_engine_weights_are_discarded_rather_than_offloaded():
    """The sync overwrites the engines' weights after every update: dropping them costs no copy; a level-1 offload
    would copy them to host and back for nothing."""
    # actor_train holds the actor's 24 GiB + 0.5 working: beside the engine's 16 GiB of weights that is 40.5 > 40
    layout = one_gpu(role("actor", (8, 8, 8)), role("rollout", (16, 16)))
    plan = plan_residency(layout, 40 * GiB, usable=1.0)
    assert plan.fits() and plan.move("rollout", "weights") == "discard" and plan.engine_sleep_level("rollout") == 2
    assert plan.move("rollout", "kv_cache") == "release"  # no KV cache without weights
    pinned = plan_residency(layout, 40 * GiB, usable=1.0, pins={("rollout", "weights"): ("resident", "offload")})
    assert pinned.fits() and pinned.move("rollout", "weights") == "offload"
    assert pinned.engine_sleep_level("rollout") == 1
    assert pinned.bytes_moved(0) == plan.bytes_moved(0) + 2 * 16 * GiB  # the level-1 round trip, for nothing


def test_host_optimizer_only_when_nothing_else_fits():
    layout = one_gpu(role("actor", (4, 4, 60)), role("rollout", (4, 10)))
    plan = plan_residency(layout, 40 * GiB, usable=1.0)
    assert plan.move("actor", "optimizer") == "host" and plan.fits()
    assert any("host memory" in n for n in plan.notes)
    assert plan_residency(layout, 90 * GiB, usable=1.0).move("actor", "optimizer") == "resident"
    no_host = plan_residency(layout, 40 * GiB, usable=1.0, allow_host=False)
    assert not no_host.fits() and "no plan fits" in no_host.notes[0]
    with pytest.raises(PlacementError) as err:
        no_host.check()
    assert "GPU 0, phase actor_train" in str(err.value) and "actor optimizer 60.0" in str(err.value)


def test_modes_all_sleep_and_manual():
    layout = colocated()
    every = plan_residency(layout, 80 * GiB, mode="all-sleep", engine_sleep_level=1)
    assert all(m in ("offload", "release") for m in every.moves.values())
    assert every.engine_sleep_level("rollout") == 1 and all(every.sleeps(r) for r in every.roles)
    manual = plan_residency(layout, 80 * GiB, mode="manual", sleep_roles={"rollout"}, engine_sleep_level=2)
    assert manual.engine_sleep_level("rollout") == 2 and not manual.sleeps("actor") and not manual.sleeps("reference")
    assert manual.move("actor", "cache") == "release"  # shared GPU: caches are trimmed in manual mode
    asked = plan_residency(layout, 80 * GiB, sleep_roles={"actor"})  # auto, with the actor asked to sleep
    assert asked.sleeps("actor") and not asked.sleeps("rollout")


def test_a_role_alone_on_its_gpus_never_moves_and_cannot_be_asked_to():
    layout = {0: (GpuShare(role("actor", (30, 30, 30))),), 1: (GpuShare(role("rollout", (20, 40))),)}
    plan = plan_residency(layout, 80 * GiB, mode="all-sleep")
    assert set(plan.moves.values()) == {"resident"}
    with pytest.raises(ConfigError, match="rollout shares no GPU"):
        plan_residency(layout, 80 * GiB, sleep_roles={"rollout"})


def test_bad_pins_are_refused():
    with pytest.raises(ConfigError, match="no role 'critic'"):
        plan_residency(colocated(), 80 * GiB, pins={("critic", "params"): "offload"})
    with pytest.raises(ConfigError, match="has no state 'kv_cache'"):
        plan_residency(colocated(), 80 * GiB, pins={("actor", "kv_cache"): "release"})
    with pytest.raises(ConfigError, match="can only be resident, discard, offload"):
        plan_residency(colocated(), 80 * GiB, pins={("rollout", "weights"): "host"})


def test_phases_follow_the_roles_present():
    assert [p.name for p in present_phases(PHASES, ["actor", "rollout"])] == ["generate", "actor_train", "sync"]
    names = [p.name for p in present_phases(PHASES, ["actor", "rollout", "critic", "reference", "reward"])]
    assert names == ["generate", "reward", "reference", "critic_infer", "actor_train", "sync", "critic_train"]


def test_engine_weights_stay_from_the_sync_to_the_next_generate():
    layout = one_gpu(role("actor", (8, 8, 8)), role("critic", (8, 8, 8)), role("rollout", (20, 20)))
    plan = plan_residency(layout, 80 * GiB, mode="all-sleep", engine_sleep_level=2)
    held = [p.name for p in plan.phases if plan.present("rollout", "weights", p.name)]
    assert held == ["generate", "sync", "critic_train"]  # a discard after the sync would lose the new weights
    assert [p.name for p in plan.phases if plan.present("critic", "params", p.name)] == ["critic_infer", "critic_train"]


# ---- properties over random layouts ----------------------------------------------------------------------------
@st.composite
def layouts(draw):
    names = ["actor", "rollout", *draw(st.lists(st.sampled_from(["reference", "critic"]), unique=True))]
    gib = st.integers(0, 24).map(float)
    sizes = {
        n: role(
            n,
            tuple(draw(gib) for _ in ROLE_STATES[n] if _ != "cache"),
            working_gib=draw(gib) / 4,
            context_gib=draw(st.sampled_from([0.0, 0.5])),
        )
        for n in names
    }
    shared_engine = draw(st.booleans())
    layout = {0: tuple(GpuShare(sizes[n]) for n in names if shared_engine or n != "rollout")}
    if not shared_engine:
        layout[1] = (GpuShare(sizes["rollout"]),)
    return layout, draw(st.integers(8, 120)) * GiB


def alternatives(plan):
    """Every consistent assignment of moves the auto planner could have chosen."""
    keys = [k for k in plan.moves]
    options = []
    for role_name, state in keys:
        lonely = not any(
            len(shares) > 1 and any(s.role == role_name for s in shares) for shares in plan.layout.values()
        )
        options.append(("resident",) if lonely else STATE_MOVES[state])
    for combo in itertools.product(*options):
        moves = dict(zip(keys, combo))
        if consistent(moves):
            yield ResidencyPlan("auto", plan.phases, moves, plan.layout, plan.gpu_bytes, plan.capacity)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_the_plan_fits_and_nothing_that_fits_is_cheaper(case):
    layout, gpu_bytes = case
    plan = plan_residency(layout, gpu_bytes)
    assert consistent(plan.moves)
    fitting = [alt for alt in alternatives(plan) if alt.fits()]
    if not fitting:
        assert not plan.fits() and plan.notes  # and it says so
        return
    assert plan.fits(), "a plan that fits exists, the planner must find one"
    assert all(plan.peak(g, p.name) <= plan.capacity for g in plan.layout for p in plan.phases)
    assert plan_cost(plan) <= min(plan_cost(alt) for alt in fitting) * (1 + 1e-12) + 1e-6  # float sums' order
    if all(m == "resident" for alt in fitting[:1] for m in alt.moves.values()):
        assert set(plan.moves.values()) == {"resident"}  # all resident fits: nothing moves
    for (r, _s), m in plan.moves.items():  # a role alone on its GPU never moves
        if all(len(shares) == 1 for shares in plan.layout.values() if any(x.role == r for x in shares)):
            assert m == "resident"


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_never_more_bytes_than_sleeping_everything(case):
    layout, gpu_bytes = case
    plan = plan_residency(layout, gpu_bytes)
    every = plan_residency(layout, gpu_bytes, mode="all-sleep")
    if every.fits():
        assert plan.fits()
        assert sum(plan.bytes_moved(g) for g in plan.layout) <= sum(every.bytes_moved(g) for g in every.layout)


@settings(max_examples=40, deadline=None)
@given(layouts(), st.sampled_from(["actor", "rollout"]))
def test_roles_pinned_resident_never_move(case, pinned):
    layout, gpu_bytes = case
    pins = {(pinned, s): "resident" for s in ROLE_STATES[pinned] if s != "cache"}
    plan = plan_residency(layout, gpu_bytes, pins=pins)
    assert all(plan.move(pinned, s) == "resident" for s in ROLE_STATES[pinned] if s != "cache")
    assert not plan.sleeps(pinned)
