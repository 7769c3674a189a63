"""A reference model is placed only when there is a KL term: a zero coefficient makes it vanish, whether KL is a
reward penalty or a loss (use_kl_loss), so no GPU memory or step time goes to a model nothing reads."""

import pytest

from hybrid_algos.train.config import GRPOConfig, PPOConfig, ReinforceConfig
from hybrid_algos.train.placement import build_plan
from hybrid_core.errors import ConfigError


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig, ReinforceConfig])
@pytest.mark.parametrize("use_kl_loss", [True, False])
def test_reference_only_with_a_kl_coefficient(cls, use_kl_loss):
    off = cls(init_kl_coef=0.0, use_kl_loss=use_kl_loss)  # not validated: a use_kl_loss set with no KL is refused
    on = cls(init_kl_coef=0.01, use_kl_loss=use_kl_loss).validate()
    assert not off.uses_reference and "reference" not in build_plan(off).roles
    assert on.uses_reference and "reference" in build_plan(on).roles


def test_grpo_ranges_drop_an_unused_reference():
    ranges = {"actor": "0", "rollout": "0", "reference": "0"}
    assert "reference" not in build_plan(GRPOConfig(init_kl_coef=0.0, placement=ranges).validate()).roles
    assert "reference" in build_plan(GRPOConfig(placement=ranges).validate()).roles


def test_colocating_a_reference_that_is_not_there_names_the_flag():
    config = GRPOConfig(init_kl_coef=0.0, colocate_all_models=False, colocate_actor_ref=True, vllm_enable_sleep=False)
    with pytest.raises(ConfigError) as e:
        config.validate()
    assert e.value.field == "colocate_actor_ref" and "init_kl_coef" in str(e.value)
