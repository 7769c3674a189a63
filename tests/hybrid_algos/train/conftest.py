"""Fixtures of the training-loop tests that run real tiny jobs."""

import shutil

import pytest
from tiny_runs import short_ray_temp_dir


@pytest.fixture(scope="module")
def one_gpu_ray(tmp_path_factory):
    """A local Ray declaring one (fake) GPU, with DeepSpeed's CPU ops built once in this process first."""
    import ray

    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built
    from hybrid_core.cluster import connect

    ensure_cpu_ops_built()
    temp = short_ray_temp_dir()
    connect(num_gpus=1, temp_dir=temp)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
