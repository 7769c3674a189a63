"""Fixtures of the training-loop tests that run real tiny jobs."""

import shutil

import pytest
from tiny_runs import short_ray_temp_dir


def _local_ray(num_gpus: int):
    """A local Ray declaring ``num_gpus`` (fake) GPUs, with DeepSpeed's CPU ops built once in this process first."""
    import ray

    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built
    from hybrid_core.cluster import connect

    ensure_cpu_ops_built()
    temp = short_ray_temp_dir()
    connect(num_gpus=num_gpus, temp_dir=temp)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def one_gpu_ray():
    yield from _local_ray(1)


@pytest.fixture(scope="module")
def two_gpu_ray():
    yield from _local_ray(2)
