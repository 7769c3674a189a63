"""``--mps`` in a run: refused before Ray where a daemon cannot start, ``auto`` off (and why) without an overlap,
and a real tiny run whose own daemon (a stand-in ``nvidia-cuda-mps-control``: no MPS on a CPU machine) serves
every worker it starts and is gone after it."""

from __future__ import annotations

import os
import uuid

import pytest
from tiny_runs import tiny_config, worker_pids

from fake_mps import write_fake_control
from hybrid_algos.train import train
from hybrid_algos.train.prepare import prepare
from hybrid_core import cluster, mps_daemon, runtime_env
from hybrid_core.errors import ConfigError

MPS_VARS = (mps_daemon.PIPE_ENV, mps_daemon.LOG_ENV, mps_daemon.SHARE_ENV)


@pytest.fixture
def mps_can_start(tmp_path, monkeypatch):
    """The probe passes here: the stand-in binary on PATH, two CUDA GPUs counted; the workers' extras as they were
    after."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_fake_control(str(bin_dir))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(mps_daemon, "cuda_gpu_count", lambda: 2)
    monkeypatch.setattr(runtime_env, "_extra", dict(runtime_env._extra))


def test_mps_on_that_cannot_start_here_is_refused_before_ray(tmp_path, monkeypatch):
    def no_ray(*a, **kw):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(cluster, "connect", no_ray)
    monkeypatch.setattr(mps_daemon, "cuda_gpu_count", lambda: 0)  # this CPU machine, whatever PATH holds
    with pytest.raises(ConfigError, match="--mps") as e:
        train(tiny_config(tmp_path / "run", max_steps=1, mps="on"))
    assert "no CUDA GPU" in str(e.value) or "not on PATH" in str(e.value)


def test_mps_auto_without_async_is_off_and_says_why(tmp_path, mps_can_start):
    prep = prepare(tiny_config(tmp_path / "run", max_steps=1, mps="auto"))
    prep.locks.release()
    assert not prep.mps.start
    assert any("--mps auto: off" in line and "asynchronous mode off" in line for line in prep.start_lines)


@pytest.mark.usefixtures("two_gpu_ray")
def test_a_run_under_its_own_daemon_gives_it_to_every_worker_and_stops_it(tmp_path, monkeypatch, mps_can_start):
    tag = uuid.uuid4().hex
    monkeypatch.setenv("HYBRID_TEST_TAG", tag)  # forwarded to every worker: finds this run's processes
    seen: dict[str, dict[str, str]] = {}

    class Watch:
        def on_step(self, metrics):
            for cls in ("EngineActor", "PolicyWorker"):
                for pid in worker_pids(tag, cls):
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        pairs = (kv.decode(errors="replace").partition("=") for kv in f.read().split(b"\0"))
                        seen[cls] = {k: v for k, _, v in pairs if k in MPS_VARS}
            seen["driver"] = {k: v for k, v in runtime_env._extra.items() if k in MPS_VARS}

    config = tiny_config(tmp_path / "run", max_steps=4, async_train=True, mps="auto", mps_engine_share=60)
    summary = train(config, callbacks=[Watch()])
    assert summary["async"]["mode"] == "shared"
    pipe = seen["driver"][mps_daemon.PIPE_ENV]
    log_dir = os.path.join(summary["run_dir"], "logs", "mps")
    for cls, share in (("EngineActor", "60"), ("PolicyWorker", "40")):  # the engines' share, the trainers' rest
        assert seen[cls] == {mps_daemon.PIPE_ENV: pipe, mps_daemon.LOG_ENV: log_dir, mps_daemon.SHARE_ENV: share}
    # stopped: quit sent once after the start, its private folder removed, the variables taken back
    with open(os.path.join(log_dir, "calls")) as f:
        assert f.read().splitlines() == ["-d", ""]
    assert not os.path.exists(os.path.dirname(pipe))
    assert not set(MPS_VARS) & set(runtime_env._extra)
    history = summary["history"]
    assert all(m["mps/engine_pct"] == 60 and m["mps/trainer_pct"] == 40 for m in history)
    assert "mps/suggested_engine_pct" in history[-1]  # after the warm-up and a window of three steps
