"""The algorithm flags of issue 20 on the command line: OpenRLHF's names work, `--help` lists every loss, estimator
and rollout correction with one line from its registry entry."""

from __future__ import annotations

import pytest

from hybrid_algos import (
    get_advantage_estimator,
    get_policy_loss,
    get_rollout_correction,
    list_advantage_estimators,
    list_policy_losses,
    list_rollout_corrections,
)
from hybrid_cli.main import load_config, main
from hybrid_cli.openrlhf_flags import rule_for

OPENRLHF_FLAGS = (
    "policy_loss_type",
    "dynamic_filtering",
    "dynamic_filtering_reward_range",
    "enable_vllm_is_correction",
    "vllm_is_truncated_threshold",
    "use_dynamic_batch",
    "train_max_tokens_per_gpu",
    "rollout_max_tokens_per_gpu",
    "packing_samples",
    "overlong_buffer_len",
    "overlong_penalty_factor",
)


def test_help_lists_every_registry_entry_with_its_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["grpo", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps; compare whitespace-insensitively
    for name in list_policy_losses(include_aliases=False):
        assert name in text and " ".join(get_policy_loss(name).summary.split()) in text, name
    for name in list_advantage_estimators(include_aliases=False):
        assert name in text and " ".join(get_advantage_estimator(name).summary.split()) in text, name
    for name in list_rollout_corrections():
        assert " ".join(get_rollout_correction(name).summary.split()) in text, name
    assert "group_norm" in text and "[needs critic]" in text and "[needs groups]" in text


def test_openrlhf_names_of_the_new_features_are_flags(tmp_path):
    config, _, _ = load_config(
        "ppo",
        [
            "--advantage_estimator",
            "group_norm",
            "--n_samples_per_prompt",
            "4",
            "--policy_loss_type",
            "gspo",
            "--dynamic_filtering",
            "--dynamic_filtering_reward_range",
            "0",
            "1",
            "--enable_vllm_is_correction",
            "--vllm_is_truncated_threshold",
            "0.5",
            "5.0",
            "--use_dynamic_batch",
            "--train_max_tokens_per_gpu",
            "8192",
            "--rollout_max_tokens_per_gpu",
            "16384",
            "--packing_samples",
            "--overlong_buffer_len",
            "256",
            "--overlong_penalty_factor",
            "1.0",
            "--generate_max_len",
            "1024",
            "--save_path",
            str(tmp_path),
        ],
    )
    assert config.policy_loss_type == "gspo" and config.policy_agg_mode == "seq-mean-token-mean"
    assert config.dynamic_filtering and config.dynamic_filtering_reward_range == (0.0, 1.0)
    assert config.enable_vllm_is_correction and config.correction_bounds == (0.5, 5.0)
    trainer = config.trainer_settings()
    assert trainer.dynamic_batch and trainer.train_token_budget == 8192 and trainer.rollout_token_budget == 16384
    assert config.packing_samples and config.overlong_buffer_len == 256 and not config.uses_critic
    for flag in OPENRLHF_FLAGS:  # OpenRLHF's own table maps each onto the setting that now exists
        assert rule_for(flag).kind not in ("refuse", "only"), (flag, rule_for(flag))
    # --max_tokens_per_gpu (the short name) is the training budget
    config, _, _ = load_config(
        "grpo", ["--use_dynamic_batch", "--max_tokens_per_gpu", "4096", "--save_path", str(tmp_path)]
    )
    assert config.train_max_tokens_per_gpu == 4096


def test_an_ignored_setting_is_an_error_on_the_command_line(tmp_path, capsys):
    assert main(["grpo", "--dry-run", "--train_max_tokens_per_gpu", "4096", "--save_path", str(tmp_path)]) == 2
    assert "use_dynamic_batch" in capsys.readouterr().err
