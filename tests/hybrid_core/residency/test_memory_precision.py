"""The memory model with bf16 master weights / bf16 Adam moments (pure functions, hand-computed numbers): the
optimizer's bytes on the GPU, DeepSpeed's flat gradient buffer at the step, and CPU Adam's host bytes, per ZeRO stage.
(tests/hybrid_algos/train/test_bf16_optimizer.py measures the same bytes on a real DeepSpeed engine.)"""

import pytest
from ppo_phases import size_role

from hybrid_core.residency import GiB, Workload, model_shape
from hybrid_core.residency.memory import ZERO3_SUB_GROUP, cpu_adam_bytes

P = 202048  # the small Llama of test_memory.py
LARGEST = 1000 * 64  # its embeddings (and LM head)


def shape():
    from transformers import LlamaConfig

    return model_shape(
        LlamaConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    )


def actor(zero_stage=1, ranks=4, **kw):
    work = Workload(bf16=True, zero_stage=zero_stage, prompt_len=16, generate_len=16, micro_rollout_batch_size=1, **kw)
    return size_role("actor", shape(), work, ranks=ranks, tp=1, gpu_bytes=80 * GiB)


BOTH = dict(bf16_master_weights=True, bf16_optimizer_states=True)


def test_shape_knows_its_largest_parameter():
    assert shape().num_params == P and shape().largest_param == LARGEST


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_optimizer_on_the_gpu_is_six_bytes_per_parameter_with_both_options(zero_stage):
    default, bf16 = actor(zero_stage), actor(zero_stage, **BOTH)
    assert default.states["optimizer"] == 12 * P / 4  # fp32 master + fp32 m, v
    assert bf16.states["optimizer"] == 6 * P / 4  # bf16 master + bf16 m, v
    # parameters and gradients are the model's, whatever the optimizer keeps
    assert bf16.states["params"] == default.states["params"] and bf16.states["grads"] == default.states["grads"]
    # the step's flat gradient partition is made in the master dtype: fp32 by default, the bf16 gradients themselves
    train_default, train_bf16 = default.working["actor_train"], bf16.working["actor_train"]
    assert train_default["fp32_grads"] == 4 * P / 4 and "bf16_grads" not in train_default
    assert train_bf16["bf16_grads"] == 2 * P / 4 and "fp32_grads" not in train_bf16
    assert bf16.host == {} and "offload_grad_staging" not in train_bf16


def test_master_weights_alone_live_with_cpu_adam():
    off = actor(1, adam_offload=True, bf16_master_weights=True)
    assert off.states["optimizer"] == 0 and "bf16_grads" not in off.working["actor_train"]
    # bf16 master (2) and its bf16 gradient (2), fp32 m, v (8), the bf16 partition (2); the staging buffer
    assert off.host == {"cpu_adam": 14 * P / 4 + 2 * LARGEST}
    # and its GPU twin: the gradients pass through a GPU staging buffer of the largest parameter on the way out
    assert off.working["actor_train"]["offload_grad_staging"] == 2 * LARGEST


@pytest.mark.parametrize(
    "zero_stage, accumulation, expected",
    [
        (1, True, 18),
        (2, True, 20),
        (2, False, 18),
        (3, True, 18),  # fp32 master weights
    ],
)
def test_cpu_adam_default_bytes_per_stage(zero_stage, accumulation, expected):
    work = Workload(bf16=True, zero_stage=zero_stage, adam_offload=True, gradient_accumulation=accumulation)
    staging = 2 * LARGEST if zero_stage < 3 else 0
    assert cpu_adam_bytes(shape(), work, ranks=4) == expected * P / 4 + staging


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_cpu_adam_bytes_with_the_options(zero_stage):
    staging = 2 * LARGEST if zero_stage < 3 else 0
    for options, per_param in ((dict(bf16_master_weights=True), 14), (BOTH, 10)):
        # ZeRO-2's accumulation buffers are views of the bf16 master gradient here: nothing more
        work = Workload(bf16=True, zero_stage=zero_stage, adam_offload=True, gradient_accumulation=True, **options)
        assert cpu_adam_bytes(shape(), work, ranks=4) == per_param * P / 4 + staging
    # the planner's "host" move for a trainer that keeps both options: what CPU Adam would then hold
    assert actor(zero_stage, **BOTH).host_optimizer == 10 * P / 4 + staging


def test_zero3_step_flattens_one_sub_group_at_a_time():
    """A partition larger than DeepSpeed's sub-group (1e9 elements) is stepped one sub-group at a time, so its flat
    gradient is at most a sub-group and the parameter that closes it; ZeRO-1 flattens the whole partition."""
    from transformers import LlamaConfig

    big = model_shape(
        LlamaConfig(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            tie_word_embeddings=False,
        )
    )
    work = dict(bf16=True, prompt_len=16, generate_len=16, micro_rollout_batch_size=1, **BOTH)
    z3 = size_role("actor", big, Workload(zero_stage=3, **work), ranks=1, tp=1, gpu_bytes=80 * GiB)
    z1 = size_role("actor", big, Workload(zero_stage=1, **work), ranks=1, tp=1, gpu_bytes=80 * GiB)
    assert big.num_params > ZERO3_SUB_GROUP + big.largest_param
    assert z3.working["actor_train"]["bf16_grads"] == 2 * (ZERO3_SUB_GROUP + big.largest_param)
    assert z1.working["actor_train"]["bf16_grads"] == 2 * big.num_params
    # same states on one rank: ZeRO-3 needs ~10 GiB less in training, even with its gathered layers
    assert z3.states["optimizer"] == z1.states["optimizer"] == 6 * big.num_params
    assert z1.working_total("actor_train") - z3.working_total("actor_train") > 9 * GiB
