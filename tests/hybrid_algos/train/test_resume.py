"""A real run SIGKILLed in the middle of saving a checkpoint keeps the previous one, and resuming from it
reproduces, exactly, the next step of a run that was never interrupted (CPU, fixed seeds)."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from tiny_runs import TINY, short_ray_temp_dir, tiny_config

from hybrid_algos.train import train
from hybrid_algos.train.checkpoint import CheckpointManager

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def _run_killed_mid_save(run_dir, tag) -> None:
    """A driver process saving its 2nd checkpoint (the actor stuck writing it) gets SIGKILL."""
    script = textwrap.dedent(f"""
        from hybrid_algos.train import GRPOConfig, train
        train(GRPOConfig(save_path={str(run_dir)!r}, max_steps=2, save_steps=1, **{json.dumps(TINY)}))
    """)
    env = {**os.environ, "HYBRID_FAULT": "actor:save_checkpoint:hang:2", "HYBRID_TEST_TAG": tag}
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not glob.glob(str(run_dir / "checkpoints" / ".tmp-step-00000002-*")):
            assert proc.poll() is None, "the run ended before its second save"
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.1)
        time.sleep(1.0)  # inside the save: the folder is made, the driver waits for the actor's state (stuck)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        _end_leftovers(tag)


def _end_leftovers(tag) -> None:
    """The killed driver's Ray processes, by pid: those that carry its environment (and so the tag), and their
    children (Ray's agents), collected before any is killed so that none is reparented away."""
    time.sleep(1)
    parent, tagged = {}, set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"HYBRID_TEST_TAG={tag}".encode() in f.read().split(b"\0"):
                    tagged.add(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    doomed, grew = set(tagged), True
    while grew:
        children = {pid for pid, ppid in parent.items() if ppid in doomed} - doomed
        grew = bool(children)
        doomed |= children
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _comparable(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def test_sigkill_mid_save_then_resume_reproduces_the_next_step(tmp_path, tmp_path_factory):
    import ray

    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built
    from hybrid_core.cluster import connect

    ensure_cpu_ops_built()
    run_dir = tmp_path / "killed"
    _run_killed_mid_save(run_dir, uuid.uuid4().hex)

    ckpt = CheckpointManager(str(run_dir / "checkpoints"))
    assert glob.glob(str(run_dir / "checkpoints" / ".tmp-step-00000002-*"))  # the half-written save is there
    path, step = ckpt.latest()
    assert step == 1 and ckpt.load_driver_state(path)["next_step"] == 1  # and the previous one is intact

    temp = short_ray_temp_dir()
    connect(num_gpus=1, temp_dir=temp)
    try:
        resumed = train(tiny_config(run_dir, max_steps=2, save_steps=1, resume=True))
        straight = train(tiny_config(tmp_path / "straight", max_steps=2))
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    assert resumed["start_step"] == 1 and len(resumed["history"]) == 2
    assert not glob.glob(str(run_dir / "checkpoints" / ".tmp-*"))  # swept at resume
    assert ckpt.latest()[1] == 2
    # step 2 after the resume is step 2 of the uninterrupted run, to the last bit
    assert _comparable(resumed["history"][1]) == _comparable(straight["history"][1])
    assert _comparable(resumed["history"][0]) == _comparable(straight["history"][0])  # restored from the checkpoint
