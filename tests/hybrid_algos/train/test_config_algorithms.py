"""The algorithm settings of the config: choices and "needs a critic / groups" come from the registries, and a
setting that would be ignored is refused with a message naming it."""

from __future__ import annotations

import pytest

from hybrid_algos import advantages as adv_module
from hybrid_algos import policy_loss as loss_module
from hybrid_algos import register_advantage_estimator, register_policy_loss
from hybrid_algos.train.config import GRPOConfig, PPOConfig, ReinforceConfig, registry_help
from hybrid_algos.train.placement import build_plan
from hybrid_core.errors import ConfigError


@pytest.fixture
def scratch_registries(monkeypatch):
    for module, names in ((adv_module, ("_REGISTRY", "_ALIASES")), (loss_module, ("_REGISTRY", "_ALIASES"))):
        for name in names:
            monkeypatch.setattr(module, name, dict(getattr(module, name)))


def test_a_new_estimator_or_loss_is_one_decorated_function(scratch_registries):
    @register_advantage_estimator("value_baseline", requires=("scores", "values"))
    def value_baseline(inputs):
        """Score minus the critic's first value."""
        return inputs.response_mask.float(), inputs.response_mask.float()

    @register_advantage_estimator("group_sign", requires=("scores", "groups"))
    def group_sign(inputs):
        """+1 / -1 around the group mean."""
        return inputs.response_mask.float(), inputs.response_mask.float()

    @register_policy_loss("plain_pg", uses=())
    def plain_pg(inputs):
        """Vanilla policy gradient."""
        return -inputs.advantages * inputs.logprobs, {}

    # The config accepts them, and knows what they need, without a list being edited anywhere.
    critic = ReinforceConfig(advantage_estimator="value_baseline").validate()
    assert critic.uses_critic and "critic" in build_plan(critic).roles
    with pytest.raises(ConfigError) as e:
        ReinforceConfig(advantage_estimator="group_sign", n_samples_per_prompt=1).validate()
    assert e.value.field == "n_samples_per_prompt"
    assert GRPOConfig(policy_loss_type="plain_pg").validate().policy_agg_mode == "token-mean"
    with pytest.raises(ConfigError) as e:  # the loss reads no dual clip: refused, not ignored
        GRPOConfig(policy_loss_type="plain_pg", dual_clip=3.0).validate()
    assert e.value.field == "dual_clip"
    text = registry_help()
    assert "value_baseline" in text and "Score minus the critic's first value. [needs critic]" in text
    assert (
        "group_sign" in text and "[needs groups]" in text and "plain_pg" in text and "Vanilla policy gradient." in text
    )


def test_builtin_needs_come_from_the_registry():
    assert PPOConfig().uses_critic and not GRPOConfig().uses_critic
    assert not PPOConfig(advantage_estimator="group_norm", n_samples_per_prompt=4).validate().uses_critic
    assert "critic" not in build_plan(PPOConfig(advantage_estimator="rloo", n_samples_per_prompt=4)).roles
    for name in ("group_norm", "rloo", "reinforce_baseline", "dr_grpo"):
        with pytest.raises(ConfigError) as e:
            ReinforceConfig(advantage_estimator=name, n_samples_per_prompt=1).validate()
        assert e.value.field == "n_samples_per_prompt", name


def test_aggregation_defaults_to_the_losss_own():
    assert GRPOConfig().policy_agg_mode == "token-mean"
    assert GRPOConfig(policy_loss_type="gspo").policy_agg_mode == "seq-mean-token-mean"
    assert GRPOConfig(policy_loss_type="dr_grpo").policy_agg_mode == "seq-mean-token-sum-norm"
    assert GRPOConfig(policy_loss_type="gspo", loss_agg_mode="token-mean").policy_agg_mode == "token-mean"
    assert PPOConfig(policy_loss_type="gspo").value_agg_mode == "token-mean"  # the critic keeps its own


def test_correction_bounds_come_from_the_type_unless_given():
    assert GRPOConfig().correction_bounds == (None, 2.0)
    assert GRPOConfig(vllm_is_correction_type="icepop").correction_bounds == (0.5, 5.0)
    assert GRPOConfig(use_icepop=True).correction_type == "icepop"
    assert GRPOConfig(vllm_is_truncated_threshold=(0.5, 5.0)).correction_bounds == (0.5, 5.0)


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"policy_loss_type": "ppo2"}, "policy_loss_type"),
        ({"loss_agg_mode": "mean"}, "loss_agg_mode"),
        ({"policy_loss_type": "gspo", "dual_clip": 3.0}, "dual_clip"),
        ({"policy_loss_type": "ppo", "eps_clip_low_high": (1.0, 0.28)}, "eps_clip_low_high"),
        ({"vllm_is_correction_type": "tis2"}, "vllm_is_correction_type"),
        (
            {"enable_vllm_is_correction": False, "vllm_is_truncated_threshold": (0.5, 5.0)},
            "vllm_is_truncated_threshold",
        ),
        ({"enable_vllm_is_correction": False, "vllm_is_correction_type": "icepop"}, "vllm_is_correction_type"),
        ({"vllm_is_truncated_threshold": (2.0, 1.0)}, "vllm_is_truncated_threshold"),
        ({"use_icepop": True, "vllm_is_correction_type": "seq-tis"}, "use_icepop"),
        (
            {"dynamic_filtering": True, "n_samples_per_prompt": 1, "advantage_estimator": "reinforce"},
            "dynamic_filtering",
        ),
        ({"dynamic_filtering": True, "dynamic_filtering_reward_range": (1.0, 0.0)}, "dynamic_filtering_reward_range"),
        ({"dynamic_filtering_reward_range": (0.0, 1.0)}, "dynamic_filtering_reward_range"),
        ({"dynamic_filtering": True, "dynamic_filtering_max_rounds": -1}, "dynamic_filtering_max_rounds"),
        ({"overlong_buffer_len": 0}, "overlong_buffer_len"),
        ({"overlong_buffer_len": 2048, "generate_max_len": 1024}, "overlong_buffer_len"),
        ({"overlong_penalty_factor": -1.0}, "overlong_penalty_factor"),
        ({"train_max_tokens_per_gpu": 4096}, "train_max_tokens_per_gpu"),
        ({"use_dynamic_batch": True, "rollout_max_tokens_per_gpu": 0}, "rollout_max_tokens_per_gpu"),
    ],
)
def test_bad_or_ignored_settings_are_refused(changes, field):
    with pytest.raises(ConfigError) as e:
        GRPOConfig(**changes).validate()
    assert e.value.field == field, e.value


def test_dynamic_filtering_needs_a_rule_reward(tmp_path):
    rm = tmp_path / "rm"
    rm.mkdir()
    with pytest.raises(ConfigError) as e:
        GRPOConfig(dynamic_filtering=True, reward_pretrain=str(rm)).validate()
    assert e.value.field == "dynamic_filtering" and "--reward_fn" in str(e.value)


def test_accepted_settings():
    GRPOConfig(policy_loss_type="cispo", eps_clip_low_high=(1.0, 0.28)).validate()  # CISPO: no lower bound
    GRPOConfig(kl_estimator="low_var_kl").validate()  # the math's aliases
    cfg = GRPOConfig(use_dynamic_batch=True, packing_samples=True, train_max_tokens_per_gpu=4096).validate()
    trainer = cfg.trainer_settings()
    assert trainer.train_token_budget == 4096 and trainer.rollout_token_budget == 4096
    assert GRPOConfig(use_dynamic_batch=True).validate().trainer_settings().train_token_budget == 16384
    GRPOConfig(
        dynamic_filtering=True,
        dynamic_filtering_reward_range=(0.0, 1.0),
        overlong_buffer_len=256,
        generate_max_len=1024,
        mask_truncated_completions=True,
    ).validate()


def test_ppo_recipe_runs_any_estimator_and_hybrid_ppo_calls_it(monkeypatch, tmp_path):
    """`hybrid ppo` and train_ppo take one path. Before, the CLI called the loop directly and accepted a non-GAE
    estimator while train_ppo raised for it; now the recipe runs any estimator (GRPO-style PPO without a critic, as
    OpenRLHF's train_ppo_ray does) and the CLI goes through the recipe."""
    import hybrid_algos.train.loop as loop
    from hybrid_algos.train import TRAINERS, train_ppo
    from hybrid_cli.main import train_command

    ran = []
    monkeypatch.setattr(loop, "train", lambda config, callbacks=(): ran.append(("loop", config)) or {"history": []})
    config = PPOConfig(
        advantage_estimator="group_norm", n_samples_per_prompt=4, save_path=str(tmp_path), use_tensorboard=False
    ).validate()
    train_ppo(config)
    assert ran == [("loop", config)]
    monkeypatch.setitem(TRAINERS, "ppo", lambda config, callbacks=(): ran.append(("recipe", config)))
    assert train_command(config) == 0
    assert ran[-1] == ("recipe", config)
