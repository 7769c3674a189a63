"""The memory model under the FSDP2 trainer backend (hand-computed numbers): every state sharded over the ranks in
the master dtype (params m P / N, grads m P / N, AdamW's moments 2 m P / N), the gathered layers and the root unit
as working memory, no DeepSpeed buffer and nothing in host memory; DeepSpeed's numbers are untouched."""

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
