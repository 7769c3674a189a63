"""Fixtures of the training-loop tests that run real tiny jobs."""

import pytest


@pytest.fixture(scope="module")
def one_gpu_ray(tmp_path_factory):
    """A local Ray declaring one (fake) GPU, with DeepSpeed's CPU ops built once in this process first."""
    import ray

    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built
    from hybrid_core.cluster import connect

    ensure_cpu_ops_built()
    connect(num_gpus=1, temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    ray.shutdown()
