"""Nodes, as OpenRLHF command lines need them: a placed plan's nodes must lie within real nodes (the other meanings --
no engines, roles on several nodes -- are the flags', tests/hybrid_algos/train/test_placement_count_flags.py)."""

import pytest

from hybrid_core.errors import PlacementError
from hybrid_core.placement import PlacementSpec
from hybrid_core.placement.ray_groups import GpuDevice, _check_plan_nodes


def _devices(nodes):
    return tuple(GpuDevice(i, node, i) for i, node in enumerate(nodes))


def test_a_placed_plan_node_must_lie_within_a_real_node():
    plan = PlacementSpec.from_ranges({"actor": "0-3", "rollout": "0-3"}, gpus_per_node=2).plan()
    _check_plan_nodes(plan, _devices(["a", "a", "b", "b"]))
    _check_plan_nodes(plan, _devices(["a", "a", "a", "a"]))  # one bigger real node holds both plan nodes: fine
    with pytest.raises(PlacementError, match=r"plan node 0 .* landed on 2 nodes") as e:
        _check_plan_nodes(plan, _devices(["a", "b", "b", "b"]))
    assert e.value.field == "placement.gpus_per_node"
