"""The memory model under the FSDP2 trainer backend (hand-computed numbers): every trainer state sharded over the
ranks in the master dtype (params m P / N, grads m P / N, AdamW's moments 2 m P / N), the gathered layers and the root
unit as working memory, no DeepSpeed buffer and nothing in host memory; a frozen model of several ranks sharded in its
own dtype; DeepSpeed's numbers are untouched."""

import pytest
from ppo_phases import size_role
from test_memory_precision import P, shape

from hybrid_core.residency import GiB, Workload


def actor(ranks=4, **kw):
    work = Workload(bf16=True, prompt_len=16, generate_len=16, micro_rollout_batch_size=1, **kw)
    return size_role("actor", shape(), work, ranks=ranks, tp=1, gpu_bytes=80 * GiB)


@pytest.mark.parametrize("ranks", [1, 4])
def test_fp32_master_shards_params_grads_and_moments_over_the_ranks(ranks):
    fsdp2 = actor(ranks, trainer_backend="fsdp2")
    assert fsdp2.states["params"] == 4 * P / ranks
    assert fsdp2.states["grads"] == 4 * P / ranks
    assert fsdp2.states["optimizer"] == 8 * P / ranks
    train = fsdp2.working["actor_train"]
    layer, root = shape().layer_params, P - 2 * shape().layer_params
    assert train["fsdp2_gather"] == 2 * (2 * layer + root)  # bf16 compute copies
    assert train["fsdp2_reduce"] == 4 * layer  # one layer's fp32 gradients before the reduce-scatter
    assert not {"reduce_bucket", "fp32_grads", "bf16_grads"} & set(train)  # DeepSpeed's buffers are not there
    assert fsdp2.host == {} and fsdp2.host_optimizer == 0


def test_bf16_master_halves_every_state():
    bf16 = actor(4, trainer_backend="fsdp2", bf16_master_weights=True, bf16_optimizer_states=True)
    assert (bf16.states["params"], bf16.states["grads"], bf16.states["optimizer"]) == (2 * P / 4, 2 * P / 4, 4 * P / 4)


def test_deepspeed_is_the_default_and_keeps_its_accounting():
    assert actor(4).states == actor(4, trainer_backend="deepspeed").states
    assert actor(4).states["params"] == 2 * P  # ZeRO-2: bf16 params whole on every rank, unlike FSDP2's shards


@pytest.mark.parametrize("bf16, b", [(True, 2), (False, 4)])
def test_a_frozen_model_of_several_ranks_is_counted_as_fsdp2_shards(bf16, b):
    """Under FSDP2 the reference is sharded by fully_shard over its N > 1 ranks in its own dtype (no master copy):
    b P / N, and its forward holds 2 layers and the root unit gathered; one rank keeps it whole."""
    work = Workload(bf16=bf16, prompt_len=16, generate_len=16, micro_rollout_batch_size=1, trainer_backend="fsdp2")
    four = size_role("reference", shape(), work, ranks=4, tp=1, gpu_bytes=80 * GiB)
    assert four.states["params"] == b * P / 4
    layer, root = shape().layer_params, P - 2 * shape().layer_params
    assert four.working["reference"]["fsdp2_gather"] == b * (2 * layer + root)
    assert "zero3_gather" not in four.working["reference"]
    one = size_role("reference", shape(), work, ranks=1, tp=1, gpu_bytes=80 * GiB)
    assert one.states["params"] == b * P and "fsdp2_gather" not in one.working["reference"]
    # DeepSpeed's rule is untouched: whole under ZeRO-2
    ds = size_role("reference", shape(), Workload(bf16=bf16, zero_stage=2), ranks=4, tp=1, gpu_bytes=80 * GiB)
    assert ds.states["params"] == b * P
