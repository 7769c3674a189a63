"""When a step may skip the actor's "old log-probs" pass: only with a single optimizer update per rollout (the
update's own pre-step log-probs are then the old ones), and only if nothing needs them before training."""

import pytest

from hybrid_algos.train.config import GRPOConfig, PPOConfig, ReinforceConfig

# 4 prompts x 2 samples = 8 samples per step
ON_POLICY = dict(
    rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8, micro_train_batch_size=4, max_epochs=1
)


@pytest.mark.parametrize(
    "cls, changes, needed",
    [
        # one update, KL as a loss term (GRPO) or no KL at all: train's own log-probs are the old ones
        (GRPOConfig, {}, False),
        (GRPOConfig, dict(init_kl_coef=0.0), False),
        (PPOConfig, dict(init_kl_coef=0.0), False),
        (ReinforceConfig, dict(init_kl_coef=0.0), False),
        # several updates per rollout: from the second on the weights have moved
        (GRPOConfig, dict(max_epochs=2), True),
        (GRPOConfig, dict(train_batch_size=4), True),
        (GRPOConfig, dict(max_epochs=2, init_kl_coef=0.0), True),
        # KL as a reward penalty: the advantages are computed from the old log-probs, before training
        (PPOConfig, {}, True),
        (ReinforceConfig, {}, True),
        (GRPOConfig, dict(use_kl_loss=False), True),
        # the adaptive KL controller steers on the KL of the old log-probs
        (GRPOConfig, dict(kl_target=0.1), True),
        # ... with no KL term there is no controller (and no reference) to feed: --kl_target is then refused
        # (train/inactive.py, tests/hybrid_algos/train/test_inactive_fields.py)
        # forced
        (GRPOConfig, dict(recompute_old_logprobs=True), True),
    ],
)
def test_needs_old_logprobs(cls, changes, needed):
    config = cls(**{**ON_POLICY, **changes}).validate()
    assert config.needs_old_logprobs is needed


def test_single_update_is_one_epoch_over_one_train_batch():
    assert GRPOConfig(**ON_POLICY).single_update
    assert not GRPOConfig(**{**ON_POLICY, "max_epochs": 2}).single_update
    assert not GRPOConfig(**{**ON_POLICY, "train_batch_size": 4}).single_update
