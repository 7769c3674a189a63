"""--dry-run plans for the run's nodes, not for the machine it runs on: without --host_memory_gb and without the GPUs
one of the run's nodes uses, this machine's available memory is not the nodes' -- the plan says what it keeps in each
node's host memory and is not refused for the laptop's memory. A local run (--num_gpus) and a machine with the nodes'
GPUs are still checked against this machine's memory."""

import pytest

from hybrid_cli.main import main
from hybrid_core.residency import GiB, host

# The demo model (its tiny vocabulary) with a 7B body: the planner keeps its optimizer in host memory (~121 GiB).
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


@pytest.fixture
def laptop(monkeypatch):
    """This machine: 8 GiB available of 16 GiB (far less than the plan keeps in host memory)."""
    monkeypatch.setattr(host, "available_memory", lambda meminfo="/proc/meminfo": 8 * GiB)
    monkeypatch.setattr(host, "total_memory", lambda meminfo="/proc/meminfo": 16 * GiB)
    import hybrid_cli.dry_run as dry_run

    monkeypatch.setattr(dry_run, "_local_gpus", lambda: 0)


def test_the_budget_is_this_machine_s_only_where_it_could_be_a_node(laptop):
    away = host.planning_budget(8, 8, 0)
    assert away.bytes is None and "0 of the 8 GPUs" in away.source
    assert host.planning_budget(8, 8, 4).bytes is None  # half a node's GPUs: not one of its nodes either
    for here in (host.planning_budget(8, 8, 8), host.planning_budget(None, 1, 0, runs_here=True)):
        assert here.local and here.bytes == pytest.approx(8 * GiB - 0.05 * 16 * GiB)


def test_a_dry_run_away_from_the_nodes_says_what_each_needs_and_does_not_refuse(laptop, capsys):
    assert main(["grpo", "--dry-run", *SEVEN_B]) == 0
    out = capsys.readouterr().out
    assert "host (node 0): 132.7 GiB needed (available memory unknown: not checked)" in out
    assert "optimizer (CPU Adam) 120.7" in out and "set --host_memory_gb" in out and "fits:" in out
    # a local run (a local Ray declaring its GPU) is this machine's: refused with the numbers, as before
    assert main(["grpo", "--dry-run", *SEVEN_B, "--num_gpus", "1"]) == 2
    err = capsys.readouterr().err
    assert "host_memory_gb: node 0: the plan keeps 120.7 GiB in host memory > 7.2 GiB available" in err
    # --host_memory_gb checks the nodes' memory wherever the dry-run runs
    assert main(["grpo", "--dry-run", *SEVEN_B, "--host_memory_gb", "100"]) == 2
    assert "> 100.0 GiB available (--host_memory_gb)" in capsys.readouterr().err
