"""``ray job submit ... -- hybrid grpo <flags>`` against a real two-node Ray cluster, as OpenRLHF users launch.

The cluster is a head node (with Ray's job server) and a second node, each with one fake GPU, started by
``ray.cluster_utils.Cluster`` on this machine (two raylets: two Ray nodes). The job's driver joins the cluster it is
submitted to (RAY_ADDRESS), places the actor on one node and the engine on the other, so the weight sync group spans
the two nodes (gloo), and trains one step of the demo. Token authentication is on throughout (the tests' conftest):
``ray job submit`` itself needs the token.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

FLAGS = [
    "grpo",
    "--max_steps",
    "1",
    "--task_length",
    "1",
    "--rollout_batch_size",
    "4",
    "--n_samples_per_prompt",
    "2",
    "--train_batch_size",
    "8",
    "--micro_train_batch_size",
    "8",
    "--init_kl_coef",
    "0",
    "--no_colocate_all_models",
    "--vllm_num_engines",
    "1",
    "--gpus_per_node",
    "1",
    "--seed",
    "3",
]


def _submit(command: list[str], *, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``ray job submit``, again while the new head's job agent is still starting (Ray answers 500 until then)."""
    for _ in range(12):
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        if "No available agent to submit job" not in result.stdout + result.stderr:
            return result
        time.sleep(5)
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_node_cluster():
    pytest.importorskip("aiohttp_cors", reason="Ray's job server needs ray[default]")
    from ray.cluster_utils import Cluster

    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

    ensure_cpu_ops_built()  # compiled once per machine; not this test's subject
    temp = tempfile.mkdtemp(prefix="hymn", dir="/tmp")  # Ray's socket paths must stay short
    port = _free_port()

    # Ray's agents default to fixed ports (52365, ...), which another Ray on this machine may hold: take free ones.
    def own_ports():
        return {"dashboard_agent_listen_port": _free_port(), "metrics_export_port": _free_port()}

    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 2,
            "num_gpus": 1,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": port,
            "temp_dir": temp,
            **own_ports(),
        },
    )
    try:
        cluster.add_node(num_cpus=2, num_gpus=1, temp_dir=temp, **own_ports())
        cluster.wait_for_nodes()
        # A job's driver finds its cluster through the address file in the cluster's temp dir (as `ray start
        # --temp-dir` writes it); cluster_utils writes only the machine-wide one, which another cluster may own.
        from ray._private.utils import write_ray_address

        write_ray_address(cluster.address, temp)
        yield cluster, f"http://127.0.0.1:{port}"
    finally:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_runs_hybrid_across_two_nodes(two_node_cluster, tmp_path):
    _, dashboard = two_node_cluster
    run = tmp_path / "run"
    env_vars = {k: os.environ[k] for k in ("PYTHONPATH", "TORCH_EXTENSIONS_DIR") if k in os.environ}
    submit = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "job",
        "submit",
        "--address",
        dashboard,
        "--runtime-env-json",
        json.dumps({"env_vars": env_vars}),
        "--",
        sys.executable,
        "-m",
        "hybrid_cli",
        *FLAGS,
        "--save_path",
        str(run),
    ]
    result = _submit(submit, timeout=420)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "succeeded" in output, output[-4000:]

    # the job trained: one step's metrics and the final model
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0] and "reward" in lines[0]
    assert (run / "final" / "config.json").is_file()

    # the plan spanned the two nodes: the actor on one, the engine on the other (so the weight sync crossed them)
    layout = json.loads((run / "logs" / "placement.json").read_text())
    assert len(layout["nodes"]) == 2 and layout["gpus_per_node"] == 1
    assert all(len(node["plan_gpus"]) == 1 for node in layout["nodes"].values())  # one bundle per node's GPU
    (actor,) = layout["roles"]["actor"]
    (engine,) = layout["roles"]["rollout"]
    assert len(actor["nodes"]) == 1 and len(engine["nodes"]) == 1 and actor["nodes"] != engine["nodes"]


def test_submitting_without_the_token_is_refused(two_node_cluster):
    _, dashboard = two_node_cluster
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}
    result = _submit(
        [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", dashboard, "--", "true"],
        timeout=120,
        env=env,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "submitted successfully" not in output
    assert "token authentication is enabled" in output, output[-2000:]
