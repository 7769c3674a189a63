"""A run whose plan cannot fit in host memory stops in prepare, before Ray starts, with the numbers (the loop calls
the same check as --dry-run); the same run with enough host memory gets past that check."""

import pytest

from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.loop import prepare, train
from hybrid_core.errors import PlacementError

SEVEN_B = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32
)


@pytest.fixture
def seven_b_folder(tmp_path):
    """A 7B-shaped model folder: config.json and a tokenizer, no weights (sizing reads the config only)."""
    from hybrid_algos.train.tiny import build_tiny_tokenizer, tiny_model_config

    folder = tmp_path / "seven-b"
    tiny_model_config(**SEVEN_B).save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def test_a_run_that_overfills_host_memory_stops_before_ray(seven_b_folder, tmp_path):
    import ray

    config = GRPOConfig(
        pretrain=seven_b_folder,
        bf16=True,
        gpu_memory_gb=80,
        host_memory_gb=32,
        save_path=str(tmp_path / "run"),
        max_steps=1,
    )
    with pytest.raises(PlacementError) as err:
        train(config)
    assert err.value.field == "host_memory_gb" and not ray.is_initialized()
    assert "node 0: the plan keeps 120.7 GiB" in str(err.value) and "> 32.0 GiB available" in str(err.value)
    prep = prepare(config.replace(host_memory_gb=200, save_path=str(tmp_path / "run2")))
    # the planner kept the optimizer in host memory, and now it fits there: the run's settings and its record say so
    assert prep.settings.trainer.adam_offload and prep.config_record["config"]["adam_offload"]
    from hybrid_algos.train.tiny import tiny_model_config
    from hybrid_core.residency.memory import count_params, model_shape

    params = count_params(tiny_model_config(**SEVEN_B))
    assert 6.4e9 < params < 6.6e9
    (use,) = prep.residency.host_use().values()
    # fp32 master, Adam m and v, fp32 grads and DeepSpeed's bf16 copy (ZeRO-2, one rank: it holds all of it), ZeRO-2's
    # bf16 gradient accumulation buffers (train_batch_size 16 = 2 micro-batches of 8) and one bf16 staging buffer of
    # the largest parameter
    assert use.optimizer == 20 * params + 2 * model_shape(tiny_model_config(**SEVEN_B)).largest_param
    assert prep.residency.to_dict()["host"]["available"] == 200 * 2**30 and not ray.is_initialized()
