"""Roles by counts -> plan (hybrid_core.placement.counts): blocks in the order given, a role on another's GPUs, engines
that fill their host's GPUs, node sizes implied by multi-node roles, and errors naming the settings the caller gave.
The role names are the caller's (none of PPO's here); OpenRLHF's flags and their meaning are
tests/hybrid_algos/train/test_placement_count_flags.py."""

import pytest

from hybrid_core.errors import PlacementError
from hybrid_core.placement import CountedRole, PlacementSpec


def role(name, nodes, per_node, **kw):
    return CountedRole(name, (nodes, per_node), (f"s.{name}_nodes", f"s.{name}_gpus"), **kw)


def engines(name, count, tp, **kw):
    return CountedRole(name, (count, tp), (f"s.{name}_count", f"s.{name}_tp"), engines=True, **kw)


def test_blocks_follow_each_other_and_a_role_on_another_takes_its_first_gpus():
    plan = PlacementSpec.from_counts(
        [
            role("policy", 1, 4),
            engines("samplers", 2, 2),
            role("judge", 1, 2, on="policy", on_field="s.together"),
            role("teacher", 1, 1),
        ]
    ).plan()
    assert {n: r.gpus for n, r in plan.roles.items()} == {
        "policy": (0, 1, 2, 3),
        "samplers": (4, 5, 6, 7),
        "judge": (0, 1),
        "teacher": (8,),
    }
    assert [w.gpus for w in plan.roles["samplers"].workers] == [(4, 5), (6, 7)] and plan.roles["samplers"].tp == 2


def test_a_role_of_no_gpus_is_absent_unless_required():
    plan = PlacementSpec.from_counts([role("policy", 1, 2), role("judge", 1, 0), engines("samplers", 0, 1)]).plan()
    assert list(plan.roles) == ["policy"]
    with pytest.raises(PlacementError, match=r"the policy has no GPUs \(s.policy_nodes x s.policy_gpus = 0 x 2\)"):
        PlacementSpec.from_counts([role("policy", 0, 2, required=True)]).plan()
    with pytest.raises(PlacementError, match="there is no judge to colocate") as err:
        PlacementSpec.from_counts(
            [role("policy", 1, 2), role("judge", 1, 0, on="policy", on_field="s.x", required=True)]
        )
    assert err.value.field == "s.x" and "Drop s.x" in err.value.fix


def test_engines_on_a_role_fill_its_gpus_exactly():
    fits = [role("policy", 1, 4), engines("samplers", 2, 2, on="policy", on_field="s.together")]
    assert PlacementSpec.from_counts(fits).plan().roles["samplers"].gpus == (0, 1, 2, 3)
    with pytest.raises(PlacementError) as err:
        PlacementSpec.from_counts([role("policy", 1, 4), engines("samplers", 1, 2, on="policy", on_field="s.together")])
    assert err.value.field == "s.samplers_count"
    assert (
        "s.together puts the engines on the policy's GPUs" in err.value.problem and "(= 1 x 2 = 2)" in err.value.problem
    )
    assert err.value.fix.startswith("Use s.samplers_count 2 with s.samplers_tp 2")


def test_a_role_on_another_fits_within_it_and_needs_it_present():
    with pytest.raises(PlacementError, match="asks for 3 GPUs and the policy has 2") as err:
        PlacementSpec.from_counts([role("policy", 1, 2), role("judge", 1, 3, on="policy", on_field="s.x")])
    assert err.value.field == "s.judge_gpus"
    with pytest.raises(PlacementError, match="there is no critic to colocate the judge with") as err:
        PlacementSpec.from_counts(
            [role("policy", 1, 2), role("critic", 1, 0), role("judge", 1, 1, on="critic", on_field="s.y")]
        )
    assert err.value.field == "s.y"


def test_multi_node_roles_imply_the_node_size_and_engines_stay_within_a_node():
    spec = PlacementSpec.from_counts([role("policy", 2, 8), engines("samplers", 4, 4, on="policy", on_field="s.t")])
    assert spec.gpus_per_node == 8 and spec.plan().num_gpus == 16
    with pytest.raises(PlacementError, match="does not fit on a node of 8 GPUs") as err:
        PlacementSpec.from_counts([role("policy", 2, 8), engines("samplers", 1, 16)])
    assert err.value.field == "s.samplers_tp"
    with pytest.raises(PlacementError, match="9 GPUs per node, but the cluster's nodes have 8") as err:
        PlacementSpec.from_counts([role("policy", 1, 9)], gpus_per_node=8)
    assert err.value.field == "s.policy_gpus"
    with pytest.raises(PlacementError, match="expected a whole number") as err:
        PlacementSpec.from_counts([role("policy", 1, 1)], gpus_per_node="8")
    assert err.value.field == "placement.gpus_per_node"
