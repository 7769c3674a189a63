"""The memory model against hand-computed numbers: what each role's states and each phase's working memory take."""

import pytest
from ppo_phases import build_layout, plan_residency, size_role

from hybrid_core.errors import ConfigError
from hybrid_core.placement import PlacementSpec
from hybrid_core.residency import GiB, Workload, model_shape

# A small Llama whose parameters are easy to count by hand:
#   embeddings 1000 x 64 = 64000; per layer q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate/up/down 3 x 64x128
#   + 2 norms x 64 = 36992; 2 layers = 73984; final norm 64; LM head 64000  ->  202048.
P = 202048
P_VALUE = 64000 + 73984 + 64 + 65  # base model + a 64 -> 1 value head with bias
CTX = 0.5 * GiB
A = 5 * 64 + 2 * 32 + 4 * 128  # values saved per token per layer
S = 32  # prompt 16 + generate 16


def small_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        **overrides,
    )


def work(**overrides):
    values = dict(
        bf16=True,
        zero_stage=3,
        micro_train_batch_size=2,
        micro_rollout_batch_size=4,
        prompt_len=16,
        generate_len=16,
        rollout_samples=8,
        engine_pool=True,
        engine_memory_fraction=0.5,
        sync_bucket_bytes=1 << 20,
    )
    values.update(overrides)
    return Workload(**values)


def test_model_shape_counts_parameters_exactly():
    shape = model_shape(small_config())
    assert shape.num_params == P and shape.kv_dim == 32 and shape.layer_params == (P - 2 * 64000) // 2
    assert model_shape(small_config(), value_head=True).num_params == P_VALUE


def test_trainer_states_and_working_memory_match_the_zero_accounting():
    actor = size_role(
        "actor", model_shape(small_config()), work(micro_rollout_batch_size=1), ranks=4, tp=1, gpu_bytes=4 * GiB
    )
    assert actor.states["params"] == 2 * P / 4  # bf16, ZeRO-3 over 4 ranks
    assert actor.states["grads"] == 2 * P / 4
    assert actor.states["optimizer"] == 12 * P / 4  # fp32 master + Adam m, v
    T = 2 * S  # tokens of one training micro batch
    train = actor.working["actor_train"]
    assert train["activations"] == T * 2 * A * 2  # no checkpointing: every layer, bf16
    assert train["logits"] == T * 1000 * (2 + 8)
    assert train["zero3_gather"] == 2 * 2 * (P - 2 * 64000) // 2  # two layers' bf16 weights
    assert actor.working["sync"]["sync_bucket"] == min(1 << 20, 2 * P)
    assert actor.states["cache"] == actor.peak_working  # what the allocator keeps reserved after the phase
    assert actor.context == CTX
    # the phase also runs the old-log-prob pass: with larger inference batches, that pass is the peak
    wide = size_role(
        "actor", model_shape(small_config()), work(micro_rollout_batch_size=16), ranks=4, tp=1, gpu_bytes=4 * GiB
    )
    assert wide.working["actor_train"]["logits"] == 16 * S * 1000 * 10


def test_checkpointing_offload_zero_stage_and_chunking_change_what_they_should():
    shape = model_shape(small_config())

    def train_only(**kw):  # inference batches of one sequence: the training pass is the phase's peak
        return work(micro_rollout_batch_size=1, **kw)

    T = 2 * S
    ckpt = size_role("actor", shape, train_only(gradient_checkpointing=True), ranks=4, tp=1, gpu_bytes=4 * GiB)
    assert ckpt.working["actor_train"]["activations"] == T * (2 * 64 + A) * 2  # layer inputs + one layer recomputed
    off = size_role("actor", shape, train_only(adam_offload=True), ranks=4, tp=1, gpu_bytes=4 * GiB)
    assert off.states["optimizer"] == 0
    z1 = size_role("actor", shape, train_only(zero_stage=1), ranks=4, tp=1, gpu_bytes=4 * GiB)
    assert z1.states["params"] == 2 * P and z1.states["grads"] == 2 * P and z1.states["optimizer"] == 12 * P / 4
    assert "zero3_gather" not in z1.working["actor_train"]
    fp32 = size_role("actor", shape, train_only(bf16=False, zero_stage=2), ranks=4, tp=1, gpu_bytes=4 * GiB)
    assert (
        fp32.states["params"] == 4 * P and fp32.states["grads"] == 4 * P / 4 and fp32.states["optimizer"] == 8 * P / 4
    )
    chunked = size_role("actor", shape, train_only(logits_chunk_bytes=16 * 4 * 1000), ranks=4, tp=1, gpu_bytes=4 * GiB)
    assert chunked.working["actor_train"]["logits"] == 16 * 1000 * 10  # one chunk of 16 positions at a time


def test_frozen_models_are_whole_on_every_rank():
    ref = size_role("reference", model_shape(small_config()), work(zero_stage=2), ranks=4, tp=1, gpu_bytes=4 * GiB)
    assert ref.states["params"] == 2 * P  # not sharded below ZeRO-3 (test_sharded_reference.py: ZeRO-3 shards it)
    assert ref.working["reference"] == {"activations": 4 * S * A * 2, "logits": 4 * S * 1000 * 10}


def test_engines_hold_their_pool_or_a_per_call_cache():
    shape = model_shape(small_config())
    vllm = size_role("rollout", shape, work(), ranks=2, tp=2, gpu_bytes=4 * GiB)
    assert vllm.states == {"weights": 2 * P / 2, "kv_cache": 0.5 * 4 * GiB - 2 * P / 2}  # TP 2; pool = 0.5 x GPU
    hf = size_role("rollout", shape, work(engine_pool=False), ranks=1, tp=1, gpu_bytes=4 * GiB)
    assert hf.states == {"weights": 2 * P, "kv_cache": 0.0}
    assert hf.working["generate"]["kv_cache"] == 8 * S * (2 * 2 * 32 * 2)  # 8 sequences x K and V of 2 layers, bf16
    with pytest.raises(ConfigError, match=r"engine\.gpu_memory_utilization"):  # weights do not fit the engine's share
        size_role("rollout", shape, work(engine_memory_fraction=0.0001), ranks=1, tp=1, gpu_bytes=GiB)


def test_plan_peaks_add_up_states_working_memory_and_contexts():
    shape = model_shape(small_config())
    placement = PlacementSpec.from_ranges(
        {"actor": "0-3", "rollout": "0-3", "reference": "0-3"}, tp={"rollout": 2}
    ).plan()
    layout = build_layout(placement, {"actor": shape, "rollout": shape, "reference": shape}, work(), 4 * GiB)
    plan = plan_residency(layout, 4 * GiB, mode="all-sleep")
    items = plan.breakdown(0, "actor_train")
    T = 2 * S
    gather = 2 * 2 * (P - 2 * 64000) // 2
    assert items[("actor", "params")] == items[("actor", "grads")] == 2 * P / 4
    assert items[("actor", "activations")] == T * 2 * A * 2 and items[("actor", "zero3_gather")] == gather
    assert ("rollout", "weights") not in items and items[("rollout", "context")] == CTX  # asleep: context only
    assert ("reference", "params") not in items  # all-sleep: the reference sleeps too
    assert plan.peak(0, "actor_train") == pytest.approx(sum(items.values()))
    sync = plan.breakdown(0, "sync")
    assert sync[("rollout", "weights")] == P and ("rollout", "kv_cache") not in sync  # weights back, no KV cache
    assert sync[("actor", "sync_bucket")] == sync[("rollout", "sync_bucket")] == min(1 << 20, 2 * P)
    gen = plan.breakdown(0, "generate")
    assert gen[("rollout", "kv_cache")] == 0.5 * 4 * GiB - P and ("actor", "params") not in gen
