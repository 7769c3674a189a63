"""Each engine's ports reach what its library reads, and ``launch_engines`` gives every engine its own window.

vLLM and SGLang cannot start an engine without a GPU, so only their modules are faked here (``vllm.LLM`` and
``sglang.Engine`` record what they were built with, including the environment at that moment); the adapters, the
port allocation, the placement and Ray (a local cluster with fake GPUs) are real. That vLLM reads these variables the
way the adapter says is checked against vLLM itself in ``contracts/test_engine_ports_contract.py``.
"""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace

import pytest
import ray

from hybrid_core.cluster import gpus_hidden_as_fakes
from hybrid_core.errors import ConfigError
from hybrid_core.placement import PlacementSpec, place
from hybrid_core.ports import BASE_PORT_ENV, PortWindow, Reserved, engine_windows
from hybrid_engines import ray_engines
from hybrid_engines.vllm_engine import (
    VLLM_DP_RESERVED,
    VLLM_TCPSTORE_OFFSET,
    VLLM_TCPSTORE_TRIES,
    VLLMEngine,
)

PORT_VARS = ("VLLM_PORT", "VLLM_DP_MASTER_PORT", "VLLM_DP_RANK_LOCAL", "VLLM_DP_RANK")


class FakeLLM:
    """Stand-in for ``vllm.LLM``: keeps its kwargs and the vLLM port variables set when it was built."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.env = {k: os.environ.get(k) for k in PORT_VARS}


class FakeSGLangEngine:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture
def fake_libraries(monkeypatch):
    """Fake ``vllm`` and ``sglang`` modules; the process environment is restored afterwards (the adapters set it)."""
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    sys.modules["vllm"].LLM = FakeLLM
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    sys.modules["sglang"].Engine = FakeSGLangEngine
    saved = dict(os.environ)
    for key in PORT_VARS:
        os.environ.pop(key, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def tcpstore_search(env: dict) -> range:
    """Where vLLM 0.26's Ray executor looks for its TCPStore port (``_select_tcpstore_port``, local DP rank 0)."""
    start = int(env["VLLM_DP_MASTER_PORT"]) + VLLM_TCPSTORE_OFFSET
    return range(start, start + VLLM_TCPSTORE_TRIES)


def test_two_tp2_vllm_engines_get_their_own_tcpstore_and_port_scans(fake_libraries):
    w0 = PortWindow("rollout engine 0", "node-a", 20000, 256)
    w1 = PortWindow("rollout engine 1", "node-a", 20256, 256)
    os.environ["VLLM_PORT"] = "29000"  # a stale inherited value: the window wins
    seen = [VLLMEngine("/no/model", tensor_parallel_size=2, ports=w).llm.env for w in (w0, w1)]
    searches = [tcpstore_search(env) for env in seen]
    for window, env, search in zip((w0, w1), seen, searches):
        assert set(search) <= set(range(window.start, window.stop)), f"{window}: TCPStore search {search}"
        scan = int(env["VLLM_PORT"])  # get_open_port scans upward from here
        assert scan in window and scan >= int(env["VLLM_DP_MASTER_PORT"]) + VLLM_DP_RESERVED
        assert scan < search.start  # the scan starts below the TCPStore search, not on it
    assert not set(searches[0]) & set(searches[1])  # the bug: both searched from port 100
    assert seen[0]["VLLM_PORT"] != seen[1]["VLLM_PORT"]


def test_vllm_without_ports_leaves_the_environment_to_vllm(fake_libraries):
    engine = VLLMEngine("/no/model")
    assert engine.llm.env["VLLM_PORT"] is None and engine.llm.env["VLLM_DP_MASTER_PORT"] is None


def test_vllm_refuses_a_dp_rank_or_a_window_too_small(fake_libraries):
    window = PortWindow("rollout engine 0", "node-a", 20000, 256)
    os.environ["VLLM_DP_RANK_LOCAL"] = "1"
    with pytest.raises(ConfigError, match="TCPStore") as e:
        VLLMEngine("/no/model", tensor_parallel_size=2, ports=window)
    assert e.value.field == "VLLM_DP_RANK_LOCAL"
    del os.environ["VLLM_DP_RANK_LOCAL"]
    with pytest.raises(ConfigError, match=f"needs {VLLMEngine.PORTS_NEEDED}"):
        VLLMEngine("/no/model", ports=PortWindow("rollout engine 0", "node-a", 20000, VLLMEngine.PORTS_NEEDED - 1))


def test_sglang_engines_take_port_and_nccl_port_from_their_windows(fake_libraries):
    from hybrid_engines.sglang_engine import SGLangEngine

    windows = [PortWindow(f"rollout engine {i}", "node-a", 20000 + 256 * i, 256) for i in range(2)]
    built = [SGLangEngine("/no/model", ports=w).engine.kwargs for w in windows]
    for w, kwargs in zip(windows, built):
        assert kwargs["port"] in w and kwargs["nccl_port"] in w and kwargs["port"] != kwargs["nccl_port"]
        assert kwargs["port"] + 233 + 6 in w  # DP attention's derived ZMQ ports (port + 233 ..)
    assert {built[0]["port"], built[0]["nccl_port"]}.isdisjoint({built[1]["port"], built[1]["nccl_port"]})
    assert "port" not in SGLangEngine("/no/model").engine.kwargs  # no window: SGLang's defaults
    with pytest.raises(ConfigError, match="nccl_port"):
        SGLangEngine("/no/model", ports=windows[0], nccl_port=29501)


# ---- launch: a real local Ray with fake GPUs ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    with gpus_hidden_as_fakes(4):
        ray.init(address="local", num_gpus=4, num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def placed(cluster):
    spec = PlacementSpec.from_ranges({"actor": "0-3", "rollout": "0-3"}, tp={"rollout": 2})
    with place(spec.plan(), timeout_s=60) as p:
        yield p


def recorder_class():
    """Stands in for ``EngineActor`` (same constructor): keeps the engine kwargs it was given (defined in a function
    so Ray ships it by value)."""

    class Recorder:
        def __init__(self, backend, engine_kwargs, *, tp_size=1, role="rollout", rank=0):
            self.kwargs, self.rank = dict(engine_kwargs), rank

        def ready(self):
            return True

        def seen(self):
            return {
                "rank": self.rank,
                "ports": self.kwargs.get("ports"),
                "node": ray.get_runtime_context().get_node_id(),
            }

    return Recorder


def test_launch_gives_each_tp2_vllm_engine_its_own_window_on_its_node(placed, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # engine_class imports it on the driver
    monkeypatch.setattr(ray_engines, "EngineActor", recorder_class())
    group = ray_engines.launch_engines(
        placed, "rollout", backend="vllm", engine_kwargs={"model": "/no/model"}, timeout_s=120
    )
    try:
        seen = sorted(ray.get([a.seen.remote() for a in group.actors], timeout=60), key=lambda s: s["rank"])
    finally:
        for a in group.actors:
            ray.kill(a)
    windows = [s["ports"] for s in seen]
    assert [w.owner for w in windows] == ["rollout engine 0", "rollout engine 1"]
    assert all(w.node == s["node"] for w, s in zip(windows, seen))  # the window is on the engine's own node
    assert windows[0].stop <= windows[1].start and windows[0].size >= VLLMEngine.PORTS_NEEDED
    assert group.port_windows == windows
    ray_ports = {n[k] for n in ray.nodes() for k in ("NodeManagerPort", "ObjectManagerPort")}
    assert not any(p in w for p in ray_ports for w in windows)


def test_launch_refuses_a_shared_port_variable_or_a_clash_before_any_actor_starts(placed, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    started = []
    monkeypatch.setattr(ray_engines, "EngineActor", started.append)  # would fail the test if Ray were asked
    with pytest.raises(ConfigError, match="VLLM_PORT"):
        ray_engines.launch_engines(
            placed, "rollout", backend="vllm", engine_kwargs={"model": "m"}, env_vars={"VLLM_PORT": "29000"}
        )
    with pytest.raises(ConfigError, match="trainer rendezvous"):
        ray_engines.launch_engines(
            placed,
            "rollout",
            backend="vllm",
            engine_kwargs={"model": "m"},
            env_vars={BASE_PORT_ENV: "24000"},
            reserved_ports=[Reserved.port(24300, "trainer rendezvous")],
        )
    assert not started


def test_engine_windows_across_nodes_reuse_numbers_per_node(cluster):
    """Two nodes of two TP-2 engines each (a placed plan's shape, faked: this cluster has one node)."""
    plan = PlacementSpec.from_ranges({"rollout": "0-7"}, tp={"rollout": 2}).plan()
    devices = [SimpleNamespace(node_id="node-a" if g < 4 else "node-b") for g in range(8)]
    windows = engine_windows(SimpleNamespace(plan=plan, devices=devices), "rollout", VLLMEngine, "vllm", {}, {})
    assert [(w.node, w.start) for w in windows] == [
        ("node-a", 20000),
        ("node-a", 20256),
        ("node-b", 20000),
        ("node-b", 20256),
    ]
    assert engine_windows(SimpleNamespace(plan=plan, devices=devices), "rollout", SimpleNamespace, "hf", {}, {}) is None
