"""The algorithm section (hybrid_algos.settings): its checks name ``algorithm.<field>``, the training config turns
them into the flags the user wrote, the flat names map onto its fields, and what the settings imply is decided here."""

from __future__ import annotations

import dataclasses

import pytest

from hybrid_algos.errors import AlgoInputError
from hybrid_algos.settings import AlgorithmSettings
from hybrid_algos.train import sections
from hybrid_algos.train.config import GRPOConfig, PPOConfig
from hybrid_core.errors import ConfigError

#: (section field changes, validate arguments, the field the error names, the flat setting that sets it, text)
BAD = [
    ({"agg_mode": "mean"}, {}, "agg_mode", "loss_agg_mode", "is not one of"),
    ({"kl_estimator": "k9"}, {}, "kl_estimator", "kl_estimator", "low_var_kl"),
    ({"policy_loss": "nope"}, {}, "policy_loss", "policy_loss_type", "plugins FILE.py"),
    ({"estimator": "nope"}, {}, "estimator", "advantage_estimator", "unknown estimator"),
    ({"kl_coef": -0.1}, {}, "kl_coef", "init_kl_coef", "must be >= 0"),
    ({"clip_eps": 1.5}, {}, "clip_eps", "eps_clip", "0 < low < 1"),
    ({"clip_low_high": (0.0, 0.3)}, {}, "clip_low_high", "eps_clip_low_high", "0 < low < 1"),
    ({"dual_clip": 1.0}, {}, "dual_clip", "dual_clip", "must be > 1"),
    ({"reward_clip": (1.0, -1.0)}, {}, "reward_clip", "reward_clip_range", "low must be below high"),
    ({"correction_type": "nope"}, {}, "correction_type", "vllm_is_correction_type", "is not one of"),
    ({"use_icepop": True, "correction_type": "seq-tis"}, {}, "use_icepop", "use_icepop", "asks for icepop"),
    ({"engine_logprobs": False}, {}, "engine_logprobs", "engine_logprobs", "must return them"),
    ({"correction_threshold": (2.0, 1.0)}, {}, "correction_threshold", "vllm_is_truncated_threshold", "LOW < HIGH"),
    ({"dynamic_filtering": True}, {"n_samples_per_prompt": 1}, "dynamic_filtering", "dynamic_filtering", "2 samples"),
    ({"dynamic_filtering": True}, {"reward_model": True}, "dynamic_filtering", "dynamic_filtering", "reward model"),
    (
        {"dynamic_filtering": True, "filter_max_rounds": -1},
        {},
        "filter_max_rounds",
        "dynamic_filtering_max_rounds",
        ">= 0",
    ),
    (
        {"dynamic_filtering": True, "filter_reward_range": (1.0, 0.0)},
        {},
        "filter_reward_range",
        "dynamic_filtering_reward_range",
        "low must be below high",
    ),
    ({"overlong_buffer_len": 0}, {}, "overlong_buffer_len", "overlong_buffer_len", "must be in [1"),
    ({"overlong_buffer_len": 9}, {"generate_max_len": 8}, "overlong_buffer_len", "overlong_buffer_len", "= 8]"),
    ({"overlong_penalty_factor": -1.0}, {}, "overlong_penalty_factor", "overlong_penalty_factor", "finite number"),
]

#: the flat settings that make each case above, where the config's defaults need more than the section's
FLAT_EXTRA = {"n_samples_per_prompt": {"n_samples_per_prompt": 1}, "generate_max_len": {"generate_max_len": 8}}


@pytest.mark.parametrize("changes, arguments, field, flat, text", BAD)
def test_the_section_refuses_each_bad_value_by_its_section_name(changes, arguments, field, flat, text):
    with pytest.raises(AlgoInputError) as e:
        AlgorithmSettings(**changes).validate(**arguments)
    assert e.value.field == f"algorithm.{field}"
    assert text in str(e.value)
    assert "--" not in str(e.value).replace("`hybrid grpo --help`", "")  # the math spells no command-line flag


def _flat(changes: dict) -> dict:
    """The flat config's settings for the section's ``changes`` (the reverse of sections.TABLE)."""
    flat_of = sections.fields_of("algorithm")
    return {flat_of[k]: v for k, v in changes.items()}


@pytest.mark.parametrize("changes, arguments, field, flat, text", BAD)
def test_through_the_config_the_same_error_names_the_flag(changes, arguments, field, flat, text, tmp_path):
    settings = _flat(changes)
    if arguments.get("reward_model"):
        settings["reward_pretrain"] = str(tmp_path)  # a folder: the models section's own check passes
    for name, extra in FLAT_EXTRA.items():
        if name in arguments:
            settings.update(extra)
    config = GRPOConfig(**settings)
    with pytest.raises(ConfigError) as e:
        config.validate()
    assert e.value.field == flat  # tests and callers read the flat name, as before the sections
    assert text in str(e.value) and "algorithm." not in str(e.value)
    with pytest.raises(AlgoInputError) as raw:  # what the config asked of its section
        config.algorithm_settings().validate(
            n_samples_per_prompt=config.n_samples_per_prompt,
            generate_max_len=config.generate_max_len,
            reward_model=config.reward_pretrain is not None,
        )
    assert str(e.value) == str(sections.in_flag_words(raw.value))  # the one text, in flag words


def test_switches_turned_off_are_spelled_as_their_no_flags():
    with pytest.raises(ConfigError) as e:
        GRPOConfig(engine_logprobs=False).validate()
    assert e.value.fix == "Drop --no_engine_logprobs, or add --no_enable_vllm_is_correction."


def test_the_table_maps_every_field_and_the_config_builds_the_section():
    assert not [p for p in sections.table_problems() if "algorithm." in p]
    mapped = set(sections.fields_of("algorithm"))
    assert mapped == {f.name for f in dataclasses.fields(AlgorithmSettings)}  # every field comes from a flag
    config = PPOConfig(lambd=0.9, init_kl_coef=0.2, use_kl_loss=True, vllm_is_truncated_threshold=(0.5, 5.0))
    algo = config.algorithm_settings()
    assert (algo.estimator, algo.lam, algo.kl_coef, algo.kl_loss) == ("gae", 0.9, 0.2, True)
    assert algo.correction_threshold == (0.5, 5.0) and algo.correction_bounds == (0.5, 5.0)
    for flat, section_default in zip(
        ("advantage_estimator", "policy_loss_type", "dynamic_filtering_max_rounds"),
        (AlgorithmSettings().estimator, AlgorithmSettings().policy_loss, AlgorithmSettings().filter_max_rounds),
    ):
        assert getattr(PPOConfig, flat) == section_default  # the section's defaults are the flat config's


def test_what_the_settings_imply():
    assert AlgorithmSettings().uses_critic and not AlgorithmSettings(estimator="group_norm").uses_critic
    assert (
        AlgorithmSettings(estimator="group_norm").needs_groups and not AlgorithmSettings(estimator="nope").uses_critic
    )
    assert not AlgorithmSettings(kl_coef=0.0).uses_reference
    assert AlgorithmSettings(policy_loss="gspo").policy_agg_mode == "seq-mean-token-mean"
    assert AlgorithmSettings(policy_loss="gspo").value_agg_mode == "token-mean"  # the critic keeps its own
    assert AlgorithmSettings(policy_loss="gspo").clip_range == (3e-4, 4e-4)
    assert AlgorithmSettings(clip_eps=0.1).clip_range == (0.1, 0.1)
    assert AlgorithmSettings(clip_low_high=[0.2, 0.28]).clip_range == (0.2, 0.28)  # a --config file's list
    assert AlgorithmSettings(use_icepop=True).correction_name == "icepop"
    assert AlgorithmSettings().correction_bounds == (None, 2.0)  # TIS's own
    assert not AlgorithmSettings(correction=False).wants_engine_logprobs
    assert AlgorithmSettings(correction=False, engine_logprobs=True).wants_engine_logprobs
    grpo = AlgorithmSettings(estimator="group_norm", kl_loss=True, kl_coef=0.001)
    assert not grpo.needs_old_logprobs(single_update=True)  # KL as a loss: the update's own log-probs serve
    assert grpo.needs_old_logprobs(single_update=False)
    assert AlgorithmSettings().needs_old_logprobs(single_update=True)  # KL in the reward needs them before training
    # the config's plan note says the flags, the section's its own names
    assert "algorithm.clip_eps" in AlgorithmSettings(policy_loss="gspo").clip_note()
    assert "--eps_clip" in GRPOConfig(policy_loss_type="gspo").clip_note()


def test_the_checks_that_need_the_rollout_run_only_when_given_it():
    dapo = AlgorithmSettings(dynamic_filtering=True, overlong_buffer_len=64)
    assert dapo.validate() is dapo  # alone: nothing to compare with
    assert dapo.validate(n_samples_per_prompt=4, generate_max_len=64) is dapo
    with pytest.raises(AlgoInputError, match="2 samples"):
        dapo.validate(n_samples_per_prompt=1)
    with pytest.raises(AlgoInputError, match="generate_max_len = 32"):
        dapo.validate(generate_max_len=32)
