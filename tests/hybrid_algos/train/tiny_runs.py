"""The smallest real training runs (tiny model, copy task, every role colocated on one fake GPU), shared by the
reliability tests, and a way to find one of this run's worker processes."""

import os
import tempfile

from hybrid_algos.train import GRPOConfig

TINY = dict(
    task="copy",
    task_length=1,
    rollout_batch_size=4,
    n_samples_per_prompt=2,
    train_batch_size=8,
    micro_train_batch_size=8,
    micro_rollout_batch_size=8,
    actor_learning_rate=2e-3,
    seed=5,
    call_timeout_s=120,
    step_timeout_s=120,
)


def tiny_config(save_path, **overrides) -> GRPOConfig:
    return GRPOConfig(save_path=str(save_path), **{**TINY, **overrides})


def worker_pids(tag: str, class_name: str) -> list[int]:
    """Ray workers of ``class_name`` whose environment holds ``HYBRID_TEST_TAG=tag`` (only this test's own)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if f"ray::{class_name}".encode() in cmdline and f"HYBRID_TEST_TAG={tag}".encode() in environ:
            found.append(int(entry))
    return found


def short_ray_temp_dir() -> str:
    """A fresh Ray temp dir with a short path: Ray's socket paths (temp dir + session + ``sockets/plasma_store``)
    must stay under 108 bytes, which pytest's own temp dirs (``/tmp/pytest-of-USER/pytest-N/popen-gwK/...``) can
    exceed."""
    return tempfile.mkdtemp(prefix="hyray", dir="/tmp")
