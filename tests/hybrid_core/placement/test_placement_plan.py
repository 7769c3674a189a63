"""RLinf-style ranges -> plan: overlap means colocation, workers and fractions, and the validation rules."""

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_core.errors import PlacementError
from hybrid_core.placement import PlacementSpec


def test_rlinf_hybrid_example():
    """Reference 003: env on 0-3, rollout on 4-7, actor on 0-7."""
    plan = PlacementSpec.from_ranges({"actor": "0-7", "env": "0-3", "rollout": "4-7"}, cluster_gpus=8).plan()
    assert plan.num_gpus == 8
    assert [plan.roles_on_gpu(g) for g in (0, 3, 4, 7)] == [
        ["actor", "env"],
        ["actor", "env"],
        ["actor", "rollout"],
        ["actor", "rollout"],
    ]
    assert [w.gpus for w in plan.roles["rollout"].workers] == [(4,), (5,), (6,), (7,)]
    assert [w.rank for w in plan.roles["actor"].workers] == list(range(8))
    assert all(w.num_gpus == 0.5 for r in plan.roles.values() for w in r.workers)


def test_tensor_parallel_engines_take_consecutive_gpus():
    plan = PlacementSpec.from_ranges({"actor": "0-7", "rollout": "0-7"}, tp={"rollout": 4}).plan()
    engines = plan.roles["rollout"].workers
    assert [w.gpus for w in engines] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert plan.roles["rollout"].tp == 4 and plan.roles["rollout"].world_size == 2
    assert plan.worker_on_gpu("rollout", 6).rank == 1


def test_fractions_follow_how_many_roles_share_each_gpu():
    plan = PlacementSpec.from_ranges({"actor": "0-3", "rollout": "0-1", "reference": "0", "critic": "2-3"}).plan()
    assert plan.worker_on_gpu("actor", 0).num_gpus == 0.3333  # actor, rollout, reference: rounded down
    assert plan.worker_on_gpu("actor", 1).num_gpus == 0.5
    assert plan.worker_on_gpu("reference", 0).num_gpus == 0.3333
    for gpu in range(plan.num_gpus):
        assert sum(plan.worker_on_gpu(r, gpu).num_gpus for r in plan.roles_on_gpu(gpu)) <= 1.0


def test_roles_may_share_gpus_without_saying_who_sleeps():
    """Placement says where roles run; what they keep on a shared GPU is the residency plan's business."""
    plan = PlacementSpec.from_ranges({"actor": "0-3", "rollout": "0-3", "critic": "0-1"}).plan()
    assert plan.shared_gpus("critic") == (0, 1) and plan.shared_gpus("actor") == (0, 1, 2, 3)


def test_plan_does_not_depend_on_the_order_roles_are_written_in():
    ranges = {"actor": "0-7", "rollout": "0-7", "reference": "0-3", "critic": "4-7"}
    kwargs = dict(tp={"rollout": 2})
    forward = PlacementSpec.from_ranges(ranges, **kwargs).plan()
    backward = PlacementSpec.from_ranges(dict(reversed(list(ranges.items()))), **kwargs).plan()
    assert forward.roles.keys() == backward.roles.keys()
    for name in ranges:
        assert forward.roles[name] == backward.roles[name]


def test_plan_serialises_to_json():
    plan = PlacementSpec.from_ranges({"actor": "0-1", "rollout": "0-1"}, tp={"rollout": 2}).plan()
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["roles"]["rollout"]["workers"] == [{"rank": 0, "gpus": [0, 1], "num_gpus": 0.5}]
    assert data["roles"]["rollout"]["tp"] == 2 and data["num_gpus"] == 2


@pytest.mark.parametrize(
    "ranges, kwargs, field, fragments",
    [
        (
            {"actor": "0-7", "rollout": "4-11"},
            dict(cluster_gpus=8),
            "placement.rollout",
            ["rollout would use GPUs 8-11", "outside the cluster's 8 GPUs (0-7)", "needs 12 GPUs"],
        ),
        (
            {"actor": "0-3", "rollout": "2-7"},
            dict(gpus_per_node=4, num_nodes=1),
            "placement.rollout",
            ["outside the cluster's 4 GPUs"],
        ),
        ({"actor": "7-3"}, {}, "placement.actor", ["runs backwards"]),
        ({"actor": "a-b"}, {}, "placement.actor", ["cannot read 'a-b'"]),
        (
            {"actor": "0-5", "rollout": "0-5"},
            dict(tp={"rollout": 4}),
            "tp.rollout",
            ["rollout has 6 GPUs (0-5), which do not split into engines of tensor-parallel size 4"],
        ),
        (
            {"actor": "0-5", "rollout": "0,2,3,5"},
            dict(tp={"rollout": 2}),
            "tp.rollout",
            ["rollout engine 0 would get GPUs 0,2, which are not consecutive"],
        ),
        (
            {"actor": "0-7", "rollout": "1-4"},
            dict(tp={"rollout": 2}, gpus_per_node=4),
            "tp.rollout",
            ["rollout engine 1 would span GPUs 3-4, across a node boundary"],
        ),
        (
            {"actor": "0-7", "rollout": "0-7"},
            dict(tp={"rollout": 8}, gpus_per_node=4),
            "tp.rollout",
            ["an engine of 8 GPUs does not fit on a node of 4 GPUs"],
        ),
        ({"actor": "0-3"}, dict(tp={"critic": 2}), "tp.critic", ["'critic' has no GPU range"]),
        ({"actor": "0-3"}, dict(tp={"actor": 0}), "tp.actor", ["at least 1"]),
        (
            {"actor": "4-7", "rollout": "4-7"},
            {},
            "placement.actor, placement.rollout",
            ["no role uses GPUs 0-3", "not physical device ids"],
        ),
        ({}, {}, "placement", ["no roles given"]),
        ({"": "0"}, {}, "placement", ["role names must be non-empty"]),
        ({"actor": "0-3"}, dict(cluster_gpus=6, gpus_per_node=4), "cluster_gpus", ["do not fill whole nodes of 4"]),
        ({"actor": "0-3"}, dict(num_nodes=2), "num_nodes", ["needs gpus_per_node"]),
    ],
)
def test_invalid_ranges_name_the_field_and_the_fix(ranges, kwargs, field, fragments):
    with pytest.raises(PlacementError) as err:
        PlacementSpec.from_ranges(ranges, **kwargs).plan()
    assert err.value.field == field
    for fragment in fragments:
        assert fragment in str(err.value)
    assert err.value.fix


def test_field_prefix_names_the_users_setting():
    with pytest.raises(PlacementError) as err:
        PlacementSpec.from_ranges({"actor": "x"}, field_prefix="cluster.component_placement").plan()
    assert err.value.field == "cluster.component_placement.actor"


ROLES = ["actor", "rollout", "critic", "reference", "env"]


@st.composite
def random_specs(draw):
    names = draw(st.lists(st.sampled_from(ROLES), min_size=1, max_size=4, unique=True))
    ranges = {}
    for name in names:
        start = draw(st.integers(0, 7))
        ranges[name] = f"{start}-{draw(st.integers(start, 9))}"
    tp = {name: draw(st.sampled_from([1, 2, 4])) for name in names if draw(st.booleans())}
    return ranges, tp, draw(st.sampled_from([None, 4, 8]))


@settings(max_examples=150, deadline=None)
@given(random_specs())
def test_any_accepted_spec_gives_a_consistent_plan(spec):
    ranges, tp, gpus_per_node = spec
    try:
        plan = PlacementSpec.from_ranges(ranges, tp=tp, gpus_per_node=gpus_per_node).plan()
    except PlacementError as err:
        assert err.field and err.fix  # rejected specs always say which setting and how to fix it
        return
    for name, role in plan.roles.items():
        lo, hi = (int(x) for x in ranges[name].split("-"))
        assert role.gpus == tuple(range(lo, hi + 1))  # every GPU of the range, each in exactly one worker
        assert sum(len(w.gpus) for w in role.workers) == len(role.gpus)
        assert [w.rank for w in role.workers] == list(range(len(role.workers)))
        for w in role.workers:
            assert len(w.gpus) == role.tp and w.gpus == tuple(range(w.gpus[0], w.gpus[0] + role.tp))
            assert len({plan.node_of(g) for g in w.gpus}) == 1
    for gpu in range(plan.num_gpus):
        here = plan.roles_on_gpu(gpu)
        assert here, "no idle GPU in the placement group"
        assert sum(plan.worker_on_gpu(r, gpu).num_gpus for r in here) <= 1.0


def test_planning_does_not_import_ray():
    """Specs are checked before Ray starts (the CLI's --dry-run never starts it)."""
    code = (
        "import sys; from hybrid_core.placement import PlacementSpec; "
        "PlacementSpec.from_ranges({'actor': '0-7', 'rollout': '0-7'}).plan().render(); "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
