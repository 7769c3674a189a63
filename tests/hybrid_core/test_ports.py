"""Port windows of engines side by side (hybrid_core.ports): disjoint on a node, reused across nodes, and every
clash with another engine, Ray or the trainer's rendezvous refused before anything starts. Pure functions: no Ray."""

from __future__ import annotations

import itertools

import pytest

from hybrid_core.errors import ConfigError
from hybrid_core.ports import (
    BASE_PORT_ENV,
    DEFAULT_BASE_PORT,
    DEFAULT_WINDOW,
    RAY_DEFAULTS,
    PortWindow,
    Reserved,
    allocate_windows,
    base_port,
    check_port_env,
    check_windows,
    ephemeral_range,
    plan_engine_ports,
    ray_reserved_ports,
)

LINUX_EPHEMERAL = (32768, 60999)


def ports_of(w: PortWindow) -> set[tuple[str, int]]:
    return {(w.node, p) for p in range(w.start, w.stop)}


def test_engines_on_one_node_get_disjoint_windows_that_pass_the_checks():
    windows = allocate_windows([(f"rollout engine {i}", "node-a") for i in range(4)])
    assert [w.start for w in windows] == [DEFAULT_BASE_PORT + i * DEFAULT_WINDOW for i in range(4)]
    for a, b in itertools.combinations(windows, 2):
        assert not ports_of(a) & ports_of(b), f"{a} and {b} share ports"
    check_windows(windows, RAY_DEFAULTS, LINUX_EPHEMERAL)  # clear of Ray's defaults and the ephemeral range


def test_engines_on_other_nodes_reuse_numbers_but_never_share_a_port():
    engines = [("e0", "node-a"), ("e1", "node-b"), ("e2", "node-a"), ("e3", "node-b")]
    windows = allocate_windows(engines, base=21000, size=200)
    by_owner = {w.owner: w for w in windows}
    assert by_owner["e0"].start == by_owner["e1"].start == 21000  # the first engine of each node
    assert by_owner["e2"].start == by_owner["e3"].start == 21200
    for a, b in itertools.combinations(windows, 2):
        assert not ports_of(a) & ports_of(b)  # a port is (node, number): same numbers only on different nodes
    check_windows(windows, RAY_DEFAULTS, LINUX_EPHEMERAL)


def test_overlapping_windows_on_one_node_are_refused_naming_both():
    a, b = PortWindow("rollout engine 0", "node-a", 25000, 256), PortWindow("rollout engine 1", "node-a", 25100, 256)
    with pytest.raises(ConfigError, match=r"rollout engine 0.*rollout engine 1.*share ports") as e:
        check_windows([a, b])
    assert e.value.field == BASE_PORT_ENV
    check_windows([a, PortWindow("rollout engine 1", "node-b", 25100, 256)])  # the same numbers on another node


def test_a_reserved_port_inside_a_window_is_refused_on_its_node_only():
    windows = allocate_windows([("rollout engine 0", "node-a"), ("rollout engine 1", "node-a")], base=22000, size=256)
    rendezvous = Reserved.port(22300, "trainer rendezvous (actor rank 0)", "node-a")
    with pytest.raises(ConfigError, match=r"rollout engine 1 .*22256-22511.*trainer rendezvous.*port 22300"):
        check_windows(windows, [rendezvous])
    check_windows(windows, [Reserved.port(22300, "trainer rendezvous", "node-b")])  # another node: no clash
    with pytest.raises(ConfigError, match="weight sync"):  # node None: on every node
        check_windows(windows, [Reserved.port(22001, "weight sync master")])
    with pytest.raises(ConfigError, match="rollout engine 0"):  # a running group's window
        check_windows(windows, [Reserved.window(PortWindow("reward engine 0", "node-a", 22100, 10))])


def test_windows_among_ray_ports_or_the_ephemeral_range_are_refused():
    with pytest.raises(ConfigError, match="Ray's default worker ports"):
        check_windows(allocate_windows([("e0", "n")], base=19900), RAY_DEFAULTS)
    with pytest.raises(ConfigError, match=r"ephemeral ports 32768-60999.*trainer's rendezvous"):
        check_windows(allocate_windows([(f"e{i}", "n") for i in range(60)]), RAY_DEFAULTS, LINUX_EPHEMERAL)
    with pytest.raises(ConfigError, match="1024-65535"):
        check_windows(allocate_windows([("e0", "n")], base=65400))


def test_ray_ports_are_reserved_on_their_own_node_and_the_gcs_everywhere():
    nodes = [
        {"NodeID": "node-a", "Alive": True, "NodeManagerPort": 20010, "ObjectManagerPort": 0},
        {"NodeID": "node-b", "Alive": True, "RuntimeEnvAgentPort": 20600},
        {"NodeID": "node-c", "Alive": False, "NodeManagerPort": 20000},
    ]
    reserved = ray_reserved_ports(nodes, "10.0.0.1:20300")
    windows = allocate_windows([("e0", "node-b"), ("e1", "node-b"), ("e2", "node-b")])  # 20000-20767 on node-b
    with pytest.raises(ConfigError, match=r"e2 .*Ray's RuntimeEnvAgentPort .*port 20600 on node node-b"):
        check_windows([windows[2]], reserved)
    with pytest.raises(ConfigError, match=r"e1 .*Ray's GCS"):
        check_windows([windows[1]], reserved)
    check_windows([windows[0]], reserved)  # node-a's node manager port and dead node-c are not node-b's
    with pytest.raises(ConfigError, match="NodeManagerPort"):
        check_windows([PortWindow("e0", "node-a", 20000, 256)], reserved)


def test_plan_engine_ports_widens_windows_to_the_engine_need_and_reads_the_base():
    engines = [("rollout engine 0", "n"), ("rollout engine 1", "n")]
    windows = plan_engine_ports(
        engines, needed=300, environ={BASE_PORT_ENV: "23000"}, ray_ports=RAY_DEFAULTS, ephemeral=LINUX_EPHEMERAL
    )
    assert [(w.start, w.size) for w in windows] == [(23000, 300), (23300, 300)]
    with pytest.raises(ConfigError, match="trainer"):
        plan_engine_ports(
            engines,
            needed=10,
            environ={},
            ray_ports=(),
            ephemeral=None,
            reserved=[Reserved.port(DEFAULT_BASE_PORT + 5, "trainer rendezvous")],
        )


@pytest.mark.parametrize("value", ["x", "80", "70000"])
def test_base_port_setting(value):
    assert base_port({}) == DEFAULT_BASE_PORT and base_port({BASE_PORT_ENV: " 24000 "}) == 24000
    with pytest.raises(ConfigError) as e:
        base_port({BASE_PORT_ENV: value})
    assert e.value.field == BASE_PORT_ENV


def test_a_port_variable_every_engine_inherits_is_refused():
    check_port_env({"VLLM_USE_FLASHINFER_SAMPLER": "0"}, ("VLLM_PORT", "VLLM_DP_MASTER_PORT"), "vllm")
    with pytest.raises(ConfigError, match=r"every vllm engine .VLLM_PORT=29000") as e:
        check_port_env({"VLLM_PORT": "29000"}, ("VLLM_PORT", "VLLM_DP_MASTER_PORT"), "vllm")
    assert e.value.field == "VLLM_PORT"


def test_window_port_offsets_stay_inside(tmp_path):
    w = PortWindow("e0", "n", 30000, 5)
    assert w.port(4) == 30004 and 30004 in w and 30005 not in w
    with pytest.raises(ConfigError, match="offset 5"):
        w.port(5)
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(str(f)) == (40000, 50000) and ephemeral_range(str(tmp_path / "none")) is None
