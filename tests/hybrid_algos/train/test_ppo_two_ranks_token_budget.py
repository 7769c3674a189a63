"""PPO (critic) on two ranks under ZeRO-3 with packing and token-budget micro-batches whose counts differ per rank
(the ranks must agree on one count, or ZeRO-3's gathers hang), the CISPO loss, and --lr_warmup_ratio for the actor
and -- new -- the critic. Real Ray with two fake GPUs, DeepSpeed, the built-in engines."""

from __future__ import annotations

import shutil

import pytest
from tiny_runs import TINY, short_ray_temp_dir

from hybrid_algos.train import PPOConfig, train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def test_ppo_two_ranks_zero3_token_budgets_cispo_and_warmup(tmp_path, tmp_path_factory):
    import ray

    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built
    from hybrid_core.cluster import connect

    ensure_cpu_ops_built()
    temp = short_ray_temp_dir()
    connect(num_gpus=2, temp_dir=temp)
    try:
        settings = {**TINY, "micro_train_batch_size": 4, "max_steps": 3, "critic_learning_rate": 2e-3}
        config = PPOConfig(
            save_path=str(tmp_path / "run"),
            **settings,
            policy_loss_type="cispo",
            packing_samples=True,
            use_dynamic_batch=True,
            train_max_tokens_per_gpu=9,
            rollout_max_tokens_per_gpu=7,
            lr_warmup_ratio=0.5,
            zero_stage=3,
            actor_num_gpus_per_node=2,
            critic_num_gpus_per_node=2,
            ref_num_gpus_per_node=2,
            vllm_num_engines=2,
        )
        history = train(config)["history"]
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    assert len(history) == 3
    for role in ("actor", "critic"):  # warm-up over half of the run's 3 updates, then the full rate
        lrs = [m[f"{role}/lr"] for m in history]
        assert lrs[0] < lrs[-1] == pytest.approx(2e-3), (role, lrs)
    assert all(m["critic/value_loss"] > 0 and m["actor/micro_batches"] >= 2 for m in history)
