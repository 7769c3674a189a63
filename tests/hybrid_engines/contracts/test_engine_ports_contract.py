"""The names the adapters' port windows rely on exist and behave as the adapters say, in the installed vLLM (0.26.0)
and SGLang (0.5.16 / 0.5.23).

vLLM: the variables ``vllm_port_env`` sets are read by ``vllm.envs``, ``ParallelConfig`` takes its DP master port from
them, and the Ray executor's TCPStore search and ``get_open_port`` land inside the window (real calls: they only
bind and release sockets). SGLang: the ``ServerArgs`` fields ``sglang_port_args`` sets, and the DP-attention offset
the window is sized for. Each part skips where its library is not installed (``hatch run vllm-contract:test``,
``hatch run sglang-contract:test``).
"""

from __future__ import annotations

import importlib
import inspect
import socket

import pytest

from hybrid_core.ports import PortWindow

pytestmark = pytest.mark.contract

WINDOW = PortWindow("rollout engine 1", "node-a", 20256, 256)


@pytest.fixture
def vllm_window(monkeypatch):
    """vLLM's environment as the adapter sets it for ``WINDOW``."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (optional env: hatch run vllm-contract:test)")
    from hybrid_engines.vllm_engine import vllm_port_env

    for name in ("VLLM_PORT", "VLLM_DP_MASTER_PORT", "VLLM_DP_RANK_LOCAL", "VLLM_DP_RANK", "VLLM_DP_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in vllm_port_env(WINDOW, {}).items():
        monkeypatch.setenv(name, value)
    return WINDOW


def test_vllm_reads_the_port_variables_the_adapter_sets(vllm_window):
    import vllm.envs as envs

    from hybrid_engines.vllm_engine import VLLM_PORT_LAYOUT, VLLMEngine

    for name in (*VLLM_PORT_LAYOUT, "VLLM_DP_RANK_LOCAL", "VLLM_DP_RANK"):
        assert name in envs.environment_variables, f"vLLM does not read {name}"
    assert vllm_window.start == envs.VLLM_DP_MASTER_PORT and vllm_window.start + 10 == envs.VLLM_PORT
    assert envs.VLLM_DP_RANK_LOCAL == 0  # defaults to VLLM_DP_RANK, 0
    assert set(VLLMEngine.PORT_ENV) == set(VLLM_PORT_LAYOUT)


def test_parallel_config_takes_the_dp_master_port_from_the_environment(vllm_window):
    from vllm.config.parallel import ParallelConfig

    config = ParallelConfig()  # data parallel size 1: __post_init__ reads the VLLM_DP_* variables
    assert config.data_parallel_master_port == vllm_window.start
    assert config.data_parallel_rank_local == 0


def test_ray_executor_searches_its_tcpstore_port_inside_the_window(vllm_window):
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    from hybrid_engines.vllm_engine import VLLM_TCPSTORE_OFFSET, VLLM_TCPSTORE_TRIES

    search = range(
        vllm_window.start + VLLM_TCPSTORE_OFFSET, vllm_window.start + VLLM_TCPSTORE_OFFSET + VLLM_TCPSTORE_TRIES
    )
    assert search.stop <= vllm_window.stop
    assert RayExecutorV2._select_tcpstore_port(0, vllm_window.start) in search
    with socket.socket() as held:  # the first port taken: the search moves on, still inside
        try:
            held.bind(("", search.start))
        except OSError:
            pytest.skip(f"port {search.start} is in use on this machine")
        assert RayExecutorV2._select_tcpstore_port(0, vllm_window.start) in range(search.start + 1, search.stop)
    # ... and the executor calls it with the config's local DP rank and DP master port (the adapter's variables)
    source = inspect.getsource(RayExecutorV2._init_executor)
    assert "_select_tcpstore_port(" in source
    assert "data_parallel_rank_local" in source and "data_parallel_master_port" in source


def test_get_open_port_scans_from_vllm_port_above_the_dp_master_reserve(vllm_window):
    from vllm.utils.network_utils import get_open_port

    from hybrid_engines.vllm_engine import VLLM_DP_RESERVED, VLLM_TCPSTORE_OFFSET

    port = get_open_port()
    assert vllm_window.start + VLLM_DP_RESERVED <= port < vllm_window.start + VLLM_TCPSTORE_OFFSET
    source = inspect.getsource(get_open_port)
    assert "VLLM_DP_MASTER_PORT" in source and f"dp_master_port + {VLLM_DP_RESERVED}" in source
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    assert "get_open_port()" in inspect.getsource(UniProcExecutor)  # TP = 1: its init port comes from the scan


def test_sglang_server_args_have_the_port_fields_the_adapter_sets():
    pytest.importorskip("sglang", reason="SGLang is not installed here (optional env: hatch run sglang-contract:test)")
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    from hybrid_engines.sglang_engine import SGLANG_PORT_ARGS, SGLangEngine

    try:  # 0.5.23: ServerArgs is a record assembled from field groups
        from sglang.srt.arg_groups.arg_utils import record_fields
    except ImportError:  # 0.5.16: a plain dataclass
        record_fields = dataclasses.fields
    fields = {f.name: f for f in record_fields(ServerArgs)}
    assert set(SGLANG_PORT_ARGS) | {"dist_init_addr"} <= set(fields)
    server_args = importlib.import_module("sglang.srt.server_args")
    delta = server_args.ZMQ_TCP_PORT_DELTA  # DP attention's ports start this far above ``port``
    assert delta + 1 + 6 < SGLangEngine.PORTS_NEEDED
    assert "server_args.port + ZMQ_TCP_PORT_DELTA" in inspect.getsource(server_args.PortArgs.init_new)
    assert "server_args.nccl_port" in inspect.getsource(server_args.PortArgs.init_new)
