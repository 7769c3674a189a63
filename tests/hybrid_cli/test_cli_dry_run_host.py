"""--dry-run and host memory: a ~7B model whose optimizer the planner keeps in host memory (CPU Adam, ~109 GiB at
set-up: it was measured at 108 GiB on the GPU; ZeRO-2 adds ~12 GiB of gradient accumulation buffers at the first step)
is refused when the node has less, with the numbers; --host_memory_gb is validated; the default is this machine's."""

import os

import pytest

from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.placement import host_memory
from hybrid_cli.main import main
from hybrid_core.errors import ConfigError

# The demo model (its tiny vocabulary) with a 7B body: ~6.5B parameters, sized on the meta device (nothing allocated).
SEVEN_B = [
    "--tiny_model",
    "hidden_size=4096",
    "intermediate_size=11008",
    "num_hidden_layers=32",
    "num_attention_heads=32",
    "num_key_value_heads=32",
    "--bf16",
    "--gpu_memory_gb",
    "80",
]


@pytest.fixture(autouse=True)
def no_ray_after():
    yield
    import ray

    assert not ray.is_initialized()


def test_a_7b_optimizer_in_host_memory_is_refused_on_a_small_node(capsys):
    assert main(["grpo", "--dry-run", *SEVEN_B, "--host_memory_gb", "1"]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert "host_memory_gb: node 0: the plan keeps 120.7" in err and "GiB in host memory > 1.0 GiB available" in err
    assert "actor optimizer (CPU Adam) 120.7" in err and "Fix:" in err and "more host memory" in err
    assert "host memory: 1.0 GiB per node (--host_memory_gb)" in captured.out
    assert "host (node 0): " in captured.out and "OVER: optimizer (CPU Adam) 120.7" in captured.out
    # the states fit, not with the processes beside them
    assert main(["grpo", "--dry-run", *SEVEN_B, "--host_memory_gb", "125"]) == 2
    assert "132.7 GiB > 125.0 GiB available" in capsys.readouterr().err
    # a node with 150 GiB fits, and the plan says what it keeps there
    assert main(["grpo", "--dry-run", *SEVEN_B, "--host_memory_gb", "150"]) == 0
    out = capsys.readouterr().out
    assert "132.7 GiB of 150.0 GiB available, ok: optimizer (CPU Adam) 120.7" in out and "fits:" in out


def test_host_memory_flag_is_validated(capsys):
    assert main(["grpo", "--dry-run", "--host_memory_gb", "-4"]) == 2
    assert "host_memory_gb: must be > 0, got -4.0" in capsys.readouterr().err
    with pytest.raises(ConfigError) as err:
        GRPOConfig(host_memory_gb=0).validate()
    assert err.value.field == "host_memory_gb" and "--host_memory_gb" in str(err.value)


def test_the_default_is_this_machine_s_available_memory_and_tiny_runs_fit(capsys):
    budget = host_memory(GRPOConfig())
    if os.path.exists("/proc/meminfo"):
        assert budget.local and budget.bytes > 0 and budget.source.startswith("MemAvailable of this machine")
    assert host_memory(GRPOConfig(host_memory_gb=64), 8).bytes == 64 * 2**30
    assert main(["grpo", "--dry-run"]) == 0  # the demo keeps kilobytes in host memory
    out = capsys.readouterr().out
    assert "host memory: " in out and "host (node 0): " in out and "optimizer (CPU Adam) 0.0" in out
