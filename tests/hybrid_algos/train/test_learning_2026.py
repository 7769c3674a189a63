"""It must learn with the 2026 losses and DAPO too: GSPO, CISPO and DAPO each lift the reward of the built-in copy
task from chance (<= 0.2) to >= 0.9 within the time budget, through the public API on a real local Ray with a fake
GPU, the built-in engine and DeepSpeed, every role colocated with sleep -- the set-up of test_learning.py, whose
settings these runs share.

DAPO here is clip-higher, dynamic sampling, the token-mean loss and no KL term, as in the paper. Its overlong
penalty is not part of this run: a built-in task's answer fills the whole generation budget (answer + stop token),
so "overlong" would punish every right answer; tests/hybrid_algos/test_dapo.py and test_dapo_in_the_loop.py cover it.
CISPO keeps the gradient of clipped tokens, so it takes the smaller step (lr 1e-3, one epoch) that keeps it stable.

Robustness: each algorithm runs at one seed in CI; `HYBRID_LEARNING_SEEDS=1,2,3` runs more.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest

from hybrid_algos.train import GRPOConfig, train
from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

BASE = dict(
    task="copy",
    task_length=1,
    max_steps=48,
    rollout_batch_size=16,
    n_samples_per_prompt=8,
    train_batch_size=32,
    micro_train_batch_size=32,
    micro_rollout_batch_size=64,
    max_epochs=2,
    actor_learning_rate=2e-3,
    call_timeout_s=300,
    use_kl_loss=True,
    kl_estimator="k3",
    init_kl_coef=0.001,
)

ALGORITHMS = {
    # the clip these settings were tuned with (PPO's 0.2); GSPO's own default is its paper's (3e-4, 4e-4)
    "gspo": dict(policy_loss_type="gspo", eps_clip=0.2),
    "cispo": dict(policy_loss_type="cispo", eps_clip_low_high=(0.2, 0.28), actor_learning_rate=1e-3, max_epochs=1),
    "dapo": dict(
        eps_clip_low_high=(0.2, 0.28),
        dynamic_filtering=True,
        dynamic_filtering_max_rounds=4,
        actor_learning_rate=1e-3,
        loss_agg_mode="token-mean",
        init_kl_coef=0.0,
    ),
}
SEEDS = [int(s) for s in os.environ.get("HYBRID_LEARNING_SEEDS", "1").split(",")]


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_2026_algorithms_learn_the_copy_task(algo: str, seed: int, tmp_path) -> None:
    config = GRPOConfig(save_path=str(tmp_path / algo), seed=seed, **{**BASE, **ALGORITHMS[algo]})
    ensure_cpu_ops_built()
    start = time.monotonic()
    summary = train(config)
    elapsed = time.monotonic() - start

    history = summary["history"]
    rewards = [m["reward"] for m in history]
    assert len(rewards) == BASE["max_steps"]
    assert rewards[0] <= 0.2, f"the untrained policy should be near chance, got {rewards[0]:.3f}"
    final = statistics.mean(rewards[-5:])
    print(f"{algo} seed {seed}: {rewards[0]:.3f} -> {final:.3f} in {elapsed:.0f} s")
    assert final >= 0.9, f"{algo} reached only {final:.3f} (rewards: {[round(r, 2) for r in rewards]})"
    assert all(m["mismatch/ratio_mean"] == pytest.approx(1.0, abs=1e-3) for m in history)  # engine == trainer
    if algo == "dapo":  # dynamic sampling really dropped groups and generated more to fill the batch
        generated = [m["dynamic_sampling/generated_prompts"] for m in history]
        assert max(generated) > BASE["rollout_batch_size"], generated
        assert "critic" not in summary["plan"].roles and "reference" not in summary["plan"].roles
