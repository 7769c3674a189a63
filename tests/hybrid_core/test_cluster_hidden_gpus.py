"""A CPU run on a GPU machine: ``CUDA_VISIBLE_DEVICES=`` hides the GPUs, and the run declares fake GPUs as on a
machine without any (Ray alone refuses: "Attempting to start raylet with 1 GPU, but CUDA_VISIBLE_DEVICES contains
[]"). Each worker then sees no CUDA device. Run in fresh processes, as ``hybrid grpo`` is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

LOCAL_RUN = textwrap.dedent("""
    import json, os, sys
    import ray
    from hybrid_core.cluster import connect, shutdown

    info = connect(num_cpus=2, num_gpus=2, temp_dir=sys.argv[1])

    @ray.remote(num_gpus=1, num_cpus=0)
    def worker():
        import torch
        return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_ids": ray.get_gpu_ids(),
                "cuda": torch.cuda.is_available()}

    seen = ray.get([worker.remote(), worker.remote()], timeout=120)
    print(json.dumps({"gpus": ray.cluster_resources().get("GPU"), "workers": seen,
                      "driver_env": os.environ.get("CUDA_VISIBLE_DEVICES")}), flush=True)
    shutdown(info)
""")


@pytest.fixture
def ray_dir():
    path = tempfile.mkdtemp(prefix="hy-")  # short: Ray's socket paths must stay under 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(hidden: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["CUDA_VISIBLE_DEVICES"] = hidden
    return env


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hidden", ["", "-1"])
def test_hidden_gpus_become_fake_gpus_no_worker_can_use(hidden, ray_dir):
    out = subprocess.run(
        [sys.executable, "-c", LOCAL_RUN, ray_dir], env=_env(hidden), capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["gpus"] == 2
    assert report["driver_env"] == hidden  # the user's setting is back once the node has started
    ids = sorted(w["cuda_visible_devices"] for w in report["workers"])
    assert ids == ["-1", "-2"]  # one fake GPU each, an id no CUDA device has
    assert not any(w["cuda"] for w in report["workers"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_demo_runs_on_the_cpu_of_a_machine_whose_gpus_are_hidden(tmp_path, ray_dir):
    run = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybrid_cli",
            "grpo",
            "--max_steps",
            "2",
            "--save_path",
            str(run),
            "--ray_temp_dir",
            ray_dir,
        ],
        env=_env(""),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    layout = json.loads((run / "logs" / "placement.json").read_text())
    devices = [d for node in layout["nodes"].values() for d in node["device_ids"]]
    assert [str(d) for d in devices] == ["-1"]  # the declared GPU (id -1), not a real one
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
