"""Which weight-sync path a placement gets: CUDA IPC whenever the engines sit on the actor's GPUs (any TP size),
broadcast for engines on GPUs of their own; never an NCCL group with two ranks on one GPU (NCCL refuses it)."""

import pytest

from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.placement import build_plan
from hybrid_algos.train.weight_sync import WeightSync, choose_mode
from hybrid_core.errors import ConfigError


def config(**kw):
    base = dict(actor_num_gpus_per_node=2, ref_num_gpus_per_node=2, vllm_num_engines=1, vllm_tensor_parallel_size=2,
                init_kl_coef=0.0)
    return GRPOConfig(**{**base, **kw}).validate()


def test_colocated_tp2_engine_goes_by_ipc_with_both_actor_ranks_together():
    cfg = config(backend="vllm")
    plan = build_plan(cfg)
    assert choose_mode(cfg, plan) == "ipc"
    sync = WeightSync("ipc", actor=None, engines=None, plan=plan, bucket_bytes=1 << 20, backend="nccl", timeout_s=5)
    assert sync.engine_for_rank == [0, 0] and sync.peers == [[0, 1], [0, 1]]


def test_colocated_tp1_engines_go_by_ipc_one_rank_each():
    cfg = config(vllm_num_engines=2, vllm_tensor_parallel_size=1)
    plan = build_plan(cfg)
    sync = WeightSync(choose_mode(cfg, plan), None, None, plan, bucket_bytes=1 << 20, backend="gloo", timeout_s=5)
    assert sync.mode == "ipc" and sync.engine_for_rank == [0, 1] and sync.peers == [[0], [1]]


def test_engines_on_their_own_gpus_go_by_broadcast():
    cfg = config(actor_num_gpus_per_node=1, vllm_tensor_parallel_size=1, colocate_all_models=False,
                 vllm_enable_sleep=False, deepspeed_enable_sleep=False, placement={"actor": "0", "rollout": "1"})
    assert choose_mode(cfg, build_plan(cfg)) == "broadcast"


def test_broadcast_forced_onto_colocated_vllm_engines_is_refused():
    cfg = config(backend="vllm", weight_sync="broadcast")
    with pytest.raises(ConfigError) as e:
        choose_mode(cfg, build_plan(cfg))
    assert e.value.field == "weight_sync" and "two ranks on one GPU" in str(e.value)


def test_ipc_forced_onto_split_engines_is_refused():
    cfg = config(actor_num_gpus_per_node=1, vllm_tensor_parallel_size=1, colocate_all_models=False,
                 vllm_enable_sleep=False, deepspeed_enable_sleep=False, placement={"actor": "0", "rollout": "1"},
                 weight_sync="ipc")
    with pytest.raises(ConfigError, match="one actor rank and one engine worker on each"):
        choose_mode(cfg, build_plan(cfg))
