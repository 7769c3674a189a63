"""Real runs: an on-policy step (one epoch, one optimizer update) never calls the actor's ``logprobs`` pass, and
trains exactly as a run that forces it; a step with several updates still calls it.

The direct observable: ``HYBRID_FAULT=actor:logprobs:raise`` makes that pass fail the run if it is ever called.
Tiny GRPO runs (tiny_runs.py) on one local Ray with a fake GPU, DeepSpeed and the built-in engine.
"""

import statistics

import pytest
from tiny_runs import tiny_config

from hybrid_algos.train import train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480), pytest.mark.usefixtures("one_gpu_ray")]

# The copy task of test_learning.py, on-policy: 128 samples per step, one optimizer update over 4 micro-batches
# (so gradient accumulation is part of what is checked: no micro-batch may see updated weights).
ON_POLICY = dict(
    rollout_batch_size=16,
    n_samples_per_prompt=8,
    train_batch_size=128,
    micro_train_batch_size=32,
    micro_rollout_batch_size=64,
    max_epochs=1,
    seed=1,
    init_kl_coef=1e-3,
    kl_estimator="k3",
)


def test_on_policy_skips_the_pass_and_trains_as_if_it_ran(tmp_path, monkeypatch):
    steps = 40
    monkeypatch.setenv("HYBRID_FAULT", "actor:logprobs:raise")  # any call of the pass fails the run
    skipped = train(tiny_config(tmp_path / "skipped", max_steps=steps, **ON_POLICY))["history"]
    monkeypatch.delenv("HYBRID_FAULT")
    forced = train(tiny_config(tmp_path / "forced", max_steps=steps, recompute_old_logprobs=True, **ON_POLICY))[
        "history"
    ]

    for m in skipped:
        assert m["actor/old_logprobs_recomputed"] == 0.0
        # old = the update's own detached log-probs: the PPO ratio is exactly 1
        assert m["actor/clip_frac"] == 0.0 and m["actor/approx_kl"] == 0.0
    assert all(m["actor/old_logprobs_recomputed"] == 1.0 for m in forced)
    # With the pass, engine and trainer log-probs of the same tokens are compared: the same fp32 weights here (the
    # sync delivered them), so only float noise; without the pass there is nothing to compare.
    assert all(m["rollout/logprob_gap"] < 1e-3 and m["rollout/logprob_gap_max"] < 1e-2 for m in forced), [
        m["rollout/logprob_gap_max"] for m in forced
    ]
    assert all("rollout/logprob_gap" not in m for m in skipped)
    # The same run either way (fixed seeds, CPU): rewards, and the KL metrics that train now reports itself. The two
    # differ only in float noise: the pass computes the old log-probs in micro-batches of 64, the update its own in
    # micro-batches of 32, so a CPU may round them differently by ~1e-7 (on the machine this was written on they
    # agree exactly over all 40 steps; the KL the driver computes from the pass differs by ~2e-7). Steps then feed on
    # each other: after enough steps one sampled token may flip and the runs part. So the first steps are compared
    # tightly (identical weights and rollouts: only that noise), the whole run by what it learns.
    exact = 8
    for key in ("reward", "kl", "kl_seq", "actor/pg_loss", "actor/kl_loss"):
        assert [m[key] for m in skipped[:exact]] == pytest.approx([m[key] for m in forced[:exact]], abs=1e-5), key
    assert any(m["kl"] != 0.0 for m in skipped), "the KL to the reference must still be reported"
    rewards = [m["reward"] for m in skipped]
    assert abs(statistics.mean(rewards[-10:]) - statistics.mean(m["reward"] for m in forced[-10:])) < 0.1
    assert rewards[0] <= 0.3 and statistics.mean(rewards[-5:]) >= statistics.mean(rewards[:5]) + 0.3, (
        f"it did not learn: {rewards}"
    )


def test_on_policy_without_kl_infers_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_FAULT", "actor:logprobs:raise")
    summary = train(tiny_config(tmp_path, max_steps=2, init_kl_coef=0.0))
    assert "reference" not in summary["plan"].roles
    for m in summary["history"]:  # no reference and no old-logprob pass: no forward-only phase at all
        assert m["time/infer"] == 0.0 and m["actor/old_logprobs_recomputed"] == 0.0 and m["kl"] == 0.0


@pytest.mark.parametrize(
    "updates",
    [dict(max_epochs=2), dict(train_batch_size=4, micro_train_batch_size=4)],
    ids=["two-epochs", "two-train-batches"],
)
def test_several_updates_per_step_run_the_pass(tmp_path, updates):
    summary = train(tiny_config(tmp_path, max_steps=2, init_kl_coef=0.0, **updates))
    for m in summary["history"]:  # without a reference, only the actor's pass infers
        assert m["actor/old_logprobs_recomputed"] == 1.0 and m["time/infer"] > 0.0
