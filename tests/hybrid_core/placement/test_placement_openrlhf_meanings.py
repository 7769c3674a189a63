"""Placement meanings OpenRLHF command lines need: no engines (generate on the actor's GPUs), and nodes (roles on
several nodes imply the node size; a placed plan's nodes must lie within real nodes)."""

import pytest

from hybrid_core.errors import PlacementError
from hybrid_core.placement import PlacementSpec
from hybrid_core.placement.ray_groups import GpuDevice, _check_plan_nodes

SLEEP: dict = {}  # who sleeps is the residency plan's, not the placement's


def test_engines_on_the_actor_s_gpus_leave_the_other_roles_where_they_were():
    plan = PlacementSpec.from_counts(
        actor_num_gpus_per_node=4,
        critic_num_gpus_per_node=2,
        ref_num_gpus_per_node=1,
        reward_num_gpus_per_node=1,
        vllm_num_engines=4,
        engines_on_actor=True,
    ).plan()
    assert plan.num_gpus == 8
    assert plan.roles["rollout"].gpus == plan.roles["actor"].gpus == (0, 1, 2, 3)
    assert plan.roles["critic"].gpus == (4, 5) and plan.roles["reference"].gpus == (6,)
    assert plan.roles["reward"].gpus == (7,)
    with pytest.raises(PlacementError, match="one per actor GPU"):
        PlacementSpec.from_counts(actor_num_gpus_per_node=4, vllm_num_engines=2, engines_on_actor=True).plan()


def test_engines_on_the_actor_with_colocated_reference():
    plan = PlacementSpec.from_counts(
        actor_num_gpus_per_node=2,
        ref_num_gpus_per_node=2,
        vllm_num_engines=2,
        colocate_actor_ref=True,
        engines_on_actor=True,
    ).plan()
    assert plan.num_gpus == 2 and plan.roles["reference"].gpus == plan.roles["rollout"].gpus == (0, 1)


def test_multi_node_roles_imply_the_node_size():
    plan = PlacementSpec.from_counts(
        actor_num_nodes=2,
        actor_num_gpus_per_node=8,
        vllm_num_engines=4,
        vllm_tensor_parallel_size=4,
        colocate_all_models=True,
        **SLEEP,
    ).plan()
    assert plan.gpus_per_node == 8 and plan.num_gpus == 16
    assert plan.node_of(7) == 0 and plan.node_of(8) == 1
    assert all(len({plan.node_of(g) for g in w.gpus}) == 1 for w in plan.roles["rollout"].workers)
    assert "on 2 nodes (8 GPUs per node)" in plan.render()
    with pytest.raises(PlacementError, match="across a node boundary"):  # engines of 4 on nodes of 6
        PlacementSpec.from_counts(
            actor_num_nodes=2,
            actor_num_gpus_per_node=6,
            vllm_num_engines=3,
            vllm_tensor_parallel_size=4,
            colocate_all_models=True,
            **SLEEP,
        ).plan()


def _devices(nodes):
    return tuple(GpuDevice(i, node, i) for i, node in enumerate(nodes))


def test_a_placed_plan_node_must_lie_within_a_real_node():
    plan = PlacementSpec.from_counts(
        actor_num_nodes=2, actor_num_gpus_per_node=2, vllm_num_engines=4, colocate_all_models=True, **SLEEP
    ).plan()
    _check_plan_nodes(plan, _devices(["a", "a", "b", "b"]))
    _check_plan_nodes(plan, _devices(["a", "a", "a", "a"]))  # one bigger real node holds both plan nodes: fine
    with pytest.raises(PlacementError, match=r"plan node 0 .* landed on 2 nodes") as e:
        _check_plan_nodes(plan, _devices(["a", "b", "b", "b"]))
    assert e.value.field == "gpus_per_node"
