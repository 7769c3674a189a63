"""The loop obeys the residency plan, with a real local Ray cluster, DeepSpeed and the built-in engine.

Each run records every move the residency owner made (``summary["residency_log"]``). The tests check that exactly
the states the plan moves are moved -- off after the last phase that needs them, back before the next one, once per
step -- that nothing moves when everything fits, that the moves do not change what is learned, and that at no
moment does a GPU hold more (by the owner's account, moves in flight counted on both sides) than its capacity.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
from tiny_runs import tiny_config

from hybrid_algos.train import train
from hybrid_core.residency import GiB

STEPS = 3
NO_CONTEXT = dict(gpu_context_gb=0.0, gpu_memory_usable=1.0)  # CPU processes hold no CUDA context


def tight_budget(tmp_path) -> float:
    """The largest per-GPU budget (GiB) at which the planner must take the engine's weights off the GPU while the
    actor trains (the tiny model is a few MB: found by asking the planner, as the run will)."""
    from hybrid_algos.train.placement import build_plan, build_residency

    config = tiny_config(tmp_path, max_steps=STEPS, **NO_CONTEXT).validate()
    placement = build_plan(config)
    for kib in range(8192, 0, -8):
        plan, run_config = build_residency(config, placement, None, prompt_len=3, generate_len=2, gpu_bytes=kib * 1024)
        if plan.move("rollout", "weights") != "resident" and not run_config.adam_offload:
            assert plan.fits()
            return kib * 1024 / GiB
    raise AssertionError("no budget makes the engine's weights move")


def run(tmp_path, name, **overrides):
    return train(tiny_config(tmp_path / name, max_steps=STEPS, **overrides))


def moves(summary, step=None):
    return [
        (e["role"], e["direction"], tuple(e["states"]))
        for e in summary["residency_log"]
        if e["event"] == "move" and (step is None or e["tag"] == step)
    ]


def planned_moves(plan) -> Counter:
    """The moves one steady-state step must make, read off the plan: between consecutive phases (around the end of
    the step too), every state that stops being resident leaves and every state that starts being resident comes
    back, one call per role and direction."""
    out = Counter()
    names = [p.name for p in plan.phases]
    for i, phase in enumerate(names):
        before = names[i - 1]
        for role in plan.roles:
            gone = tuple(
                s
                for s in plan.resident_states(role, before)
                if s not in plan.resident_states(role, phase) and s != "cache"
            )
            back = tuple(
                s
                for s in plan.resident_states(role, phase)
                if s not in plan.resident_states(role, before) and s != "cache"
            )
            if gone:
                out[(role, "off", gone)] += 1
            if back:
                out[(role, "on", back)] += 1
    return out


@pytest.fixture(scope="module")
def resident(one_gpu_ray, tmp_path_factory):
    return run(tmp_path_factory.mktemp("resident"), "resident", **NO_CONTEXT)


@pytest.mark.slow
def test_nothing_moves_when_everything_fits(resident):
    plan = resident["residency"]
    assert set(plan.moves.values()) <= {"resident"} and plan.fits()
    assert moves(resident) == []
    for m in resident["history"]:
        assert m.get("bytes/sleep", 0) == 0 and m.get("bytes/wake", 0) == 0 and m["time/sync"] > 0


@pytest.mark.slow
def test_a_tight_budget_moves_exactly_what_the_plan_says(one_gpu_ray, resident, tmp_path):
    summary = run(tmp_path, "tight", gpu_memory_gb=tight_budget(tmp_path), **NO_CONTEXT)
    plan = summary["residency"]
    assert plan.fits()
    assert plan.move("rollout", "weights") == "discard" and plan.move("rollout", "kv_cache") == "release"
    expected = planned_moves(plan)
    assert expected[("rollout", "off", ("weights", "kv_cache"))] == 1  # after generating: sleep level 2
    assert expected[("rollout", "on", ("weights",))] == 1  # for the sync, which refills them
    assert expected[("rollout", "on", ("kv_cache",))] == 1  # for the next generate
    for step in range(1, STEPS):  # steady state (step 0 also finds the engines as they started)
        assert Counter(moves(summary, step)) == expected, moves(summary, step)
    # the moves change where memory is, not what is computed
    assert [m["reward"] for m in summary["history"]] == pytest.approx(
        [m["reward"] for m in resident["history"]], abs=1e-6
    )
    _never_above_capacity(summary)


@pytest.mark.slow
def test_pins_and_all_sleep_move_the_trainers_state_too(one_gpu_ray, resident, tmp_path):
    pinned = run(tmp_path, "pinned", residency_pins={"actor.optimizer": "offload"}, **NO_CONTEXT)
    assert pinned["residency"].move("actor", "optimizer") == "offload"
    for step in range(1, STEPS):
        assert Counter(moves(pinned, step)) == Counter(
            [("actor", "off", ("optimizer",)), ("actor", "on", ("optimizer",))]
        ), moves(pinned, step)
    offloaded = [e["bytes"] for e in pinned["residency_log"] if e["event"] == "move" and e["role"] == "actor"]
    assert all(b > 0 for b in offloaded)  # DeepSpeed's optimizer state really moved (and was counted)

    every = run(tmp_path, "every", residency="all-sleep", residency_overlap=False, **NO_CONTEXT)
    assert planned_moves(every["residency"]) == Counter(
        {
            ("actor", "off", ("grads", "optimizer")): 1,
            ("actor", "off", ("params",)): 1,
            ("actor", "on", ("params", "grads", "optimizer")): 1,
            ("rollout", "off", ("weights", "kv_cache")): 1,
            ("rollout", "on", ("weights",)): 1,
            ("rollout", "on", ("kv_cache",)): 1,
            ("reference", "off", ("params",)): 1,
            ("reference", "on", ("params",)): 1,
        }
    )
    for step in range(1, STEPS):
        assert Counter(moves(every, step)) == planned_moves(every["residency"]), moves(every, step)
        assert every["history"][step]["bytes/sleep"] > 0 and every["history"][step]["bytes/wake"] > 0
    for summary in (pinned, every):
        assert [m["reward"] for m in summary["history"]] == pytest.approx(
            [m["reward"] for m in resident["history"]], abs=1e-6
        )


def _never_above_capacity(summary) -> None:
    """At every phase entered: what the GPU may hold (resident + in flight) plus the phase's working memory fits."""
    plan = summary["residency"]
    entered = [e for e in summary["residency_log"] if e["event"] == "enter"]
    assert len(entered) >= STEPS * len(plan.phases)
    for e in entered:
        for gpu, held in e["held"].items():
            working = sum(
                s.size.working_total(e["phase"]) * s.workers
                for s in plan.layout[gpu]
                if s.role in next(p for p in plan.phases if p.name == e["phase"]).needs
            )
            assert held + working <= plan.capacity + 1, (e, working, plan.capacity / GiB)


def test_refinement_catches_memory_that_keeps_growing_and_never_shrinks_the_overhead(tmp_path):
    """The plan is refined after steps 1, 2, 4, 8, ...: memory reserved beyond the model that grows over the first
    steps (the allocator's fragmentation as sequence lengths vary: 1.5B on an H200 grew 62 -> 84 GiB) is caught at
    the next refinement, a reading lower than an earlier one keeps the larger overhead, and a growth that no longer
    fits changes the moves. The GPU readings are given (no CUDA here); everything else is the loop's own code."""
    from types import SimpleNamespace

    from hybrid_algos.train.placement import build_plan, build_residency
    from hybrid_algos.train.session import TrainingSession, _refines_after
    from hybrid_core.gpu_memory import GpuMemory
    from hybrid_core.residency import ResidencyOwner

    assert [k for k in range(20) if _refines_after(k)] == [0, 1, 3, 7, 15]
    config = tiny_config(tmp_path, max_steps=STEPS, **NO_CONTEXT).validate()
    budget = 4 * tight_budget(tmp_path) * GiB  # everything fits resident, with room to spare
    plan, _ = build_residency(config, build_plan(config), None, prompt_len=3, generate_len=2, gpu_bytes=budget)
    assert all(m == "resident" for m in plan.moves.values())
    held = sum(plan.breakdown(0, "sync").values())
    used = {"bytes": held}

    class Guard:
        enabled = True

        def read(self, gpu):
            return GpuMemory(free=budget - used["bytes"], total=budget)

    on_gpu = {r: set(plan.resident_states(r, "sync")) for r in plan.roles}  # the owner's record: all resident
    owner = SimpleNamespace(plan=plan, guard=Guard(), phase="sync", settle=lambda: None, on_gpu=lambda: on_gpu)
    owner.refine = functools.partial(ResidencyOwner.refine, owner)  # the owner's own refinement, over this record
    session = TrainingSession.__new__(TrainingSession)
    session.owner, session.settings, session.groups = owner, config.settings(), []
    session.prep = SimpleNamespace(residency=plan, run_dir=str(tmp_path))

    used["bytes"] = held + 0.10 * budget  # step 1: 10 % beyond the model
    first = session.refine_residency(1)
    assert first["residency/overhead_gib"] * GiB == pytest.approx(0.10 * budget, rel=1e-6)
    assert owner.plan.overhead[0] == pytest.approx(0.10 * budget, rel=1e-6)
    used["bytes"] = (
        held + 0.10 * budget + 0.20 * budget
    )  # step 2: grown by 20 % (the old overhead is not counted twice)
    session.refine_residency(2)
    assert owner.plan.overhead[0] == pytest.approx(0.30 * budget, rel=1e-6)
    assert "refined after step 2" in owner.plan.notes[-1] and not any("after step 1" in n for n in owner.plan.notes)
    used["bytes"] = held + 0.05 * budget  # a lower reading later: the larger overhead stays
    assert session.refine_residency(4)["residency/replanned"] == 0.0
    assert owner.plan.overhead[0] == pytest.approx(0.30 * budget, rel=1e-6)
    used["bytes"] = held + 0.30 * budget + 0.55 * budget  # growth that does not fit resident: the moves change
    grown = session.refine_residency(8)
    assert grown["residency/replanned"] == 1.0 and any(m != "resident" for m in owner.plan.moves.values())
    assert owner.plan.fits()
    import json

    written = json.loads((tmp_path / "residency.json").read_text())
    assert written["overhead"]["0"] == pytest.approx(0.85 * budget)
    assert owner.plan.host == plan.host is not None  # the refined plan checks the same host memory
    assert written["host"]["available"] == plan.host.bytes and "0" in written["host"]["nodes"]
