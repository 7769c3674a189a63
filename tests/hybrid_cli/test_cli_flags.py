"""Flags and --config files: types, switches, pairs, mappings, precedence, and errors that name the flag."""

import pytest

from hybrid_algos.train.config import GRPOConfig, PPOConfig, RLConfig
from hybrid_cli.flags import field_specs
from hybrid_cli.main import load_config, main
from hybrid_cli.openrlhf import UNSUPPORTED
from hybrid_core.errors import ConfigError


def config_of(*argv, command="ppo"):
    return load_config(command, list(argv))[0]


def error_of(*argv, command="ppo"):
    with pytest.raises(ConfigError) as e:
        load_config(command, list(argv))
    return e.value


def test_every_config_field_is_a_flag():
    from hybrid_cli.main import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["ppo"]
    flags = {s for a in sub._actions for s in a.option_strings}
    for name in field_specs(RLConfig):
        assert f"--{name}" in flags


def test_types_switches_pairs_and_mappings(tmp_path):
    c = config_of("--zero_stage", "3", "--bf16", "--actor_learning_rate", "5e-7", "--eps_clip_low_high", "0.2", "0.28",
                  "--max_steps", "7", "--use_wandb", "KEY", "--placement", "actor=0-1", "rollout=0-1",
                  "--tiny_model", "hidden_size=32", "num_hidden_layers=1", "--no_vllm_enable_sleep",
                  "--deepspeed_enable_sleep", "--save_path", str(tmp_path))
    assert c.zero_stage == 3 and c.bf16 is True and c.actor_learning_rate == 5e-7
    assert c.eps_clip_low_high == (0.2, 0.28) and c.clip_range == (0.2, 0.28)
    assert c.max_steps == 7 and c.use_wandb == "KEY"
    assert c.placement == {"actor": "0-1", "rollout": "0-1"}
    assert c.tiny_model == {"hidden_size": 32, "num_hidden_layers": 1}
    assert c.vllm_enable_sleep is False and c.deepspeed_enable_sleep is True
    assert config_of("--kl_target", "none").kl_target is None


def test_algorithm_defaults_and_aliases():
    assert isinstance(config_of(command="grpo"), GRPOConfig)
    assert config_of(command="grpo").advantage_estimator == "group_norm"
    assert config_of(command="reinforce").advantage_estimator == "reinforce"
    # OpenRLHF's names for the estimators are accepted by every command (the registry's aliases)
    for name in ("reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "gae"):
        extra = ["--n_samples_per_prompt", "4"] if name not in ("gae", "reinforce") else []
        assert config_of("--advantage_estimator", name, *extra).advantage_estimator == name
    c = config_of("--load_checkpoint", "--ckpt_path", ".")  # OpenRLHF's: resume if a checkpoint exists, else start
    assert c.resume_if_exists is True and c.resume is False


def test_demo_defaults_vs_openrlhf_defaults():
    demo = config_of()
    assert demo.colocate_all_models and demo.vllm_enable_sleep and demo.backend == "hf"
    config, _, notes = load_config("ppo", ["--actor_num_gpus_per_node", "2", "--vllm_num_engines", "2",
                                           "--ref_num_gpus_per_node", "2", "--critic_num_gpus_per_node", "2"])
    assert not config.colocate_all_models and not config.vllm_enable_sleep and not config.deepspeed_enable_sleep
    assert config.backend == "vllm" and config.train_batch_size == 128 and config.vllm_gpu_memory_utilization == 0.95
    assert "OpenRLHF" in notes[0] and "backend=vllm" in notes[0]
    # explicit flags still win over OpenRLHF's defaults
    config = config_of("--colocate_all_models", "--actor_num_gpus_per_node", "1", "--backend", "hf",
                       "--ref_num_gpus_per_node", "1", "--critic_num_gpus_per_node", "1", "--rollout_batch_size", "8",
                       "--train_batch_size", "8")
    assert config.colocate_all_models and config.backend == "hf" and config.rollout_batch_size == 8


@pytest.mark.parametrize("argv, field, text", [
    (["--lora_rank", "64"], "lora_rank", "OpenRLHF flag that hybrid does not support yet (LoRA)"),
    (["--remote_rm_url", "http://x"], "remote_rm_url", "does not support yet"),
    (["--ref_reward_offload"], "ref_reward_offload", "does not support yet"),
    (["--actor_learning_rte", "1e-6"], "actor_learning_rte", "Did you mean --actor_learning_rate?"),
    (["--zzz"], "zzz", "unknown flag --zzz"),
    (["--pre", "x"], "pre", "unknown flag"),  # no abbreviations
    (["--zero_stage", "three"], "zero_stage", "invalid"),
    (["--bf16", "true"], "arguments", "unexpected value(s) true"),
    (["-x"], "x", "two dashes"),
    (["--eps_clip_low_high", "0.2"], "eps_clip_low_high", "expected 2 arguments"),
    (["--placement", "actor"], "placement", "KEY=VALUE"),
])
def test_bad_flags_name_the_flag(argv, field, text):
    e = error_of(*argv)
    assert e.field == field and text in str(e)


def test_unknown_flag_exit_status_and_message(capsys):
    assert main(["ppo", "--lora_rank", "8", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid: error: lora_rank:") and "--lora_rank" in err
    assert main(["pp0"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_every_unsupported_flag_is_reported_as_such():
    for name in UNSUPPORTED:
        e = error_of(f"--{name}")
        assert e.field == name and "does not support yet" in str(e), name


def test_validation_errors_reach_the_user(capsys):
    assert main(["ppo", "--train_batch_size", "5", "--dry-run"]) == 2
    assert "train_batch_size" in capsys.readouterr().err
    assert main(["ppo", "--pretrain", "/no/such/model", "--dry-run"]) == 2
    assert "pretrain: no model folder" in capsys.readouterr().err


def test_help_and_version(capsys):
    assert main([]) == 0
    assert "ppo" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["ppo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--vllm_enable_sleep" in out and "--colocate_all_models" in out and "--dry-run" in out


# ---- --config FILE.yaml -----------------------------------------------------------------------------------------
def test_yaml_then_flags_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("zero_stage: 3\nactor_learning_rate: 5e-7\neps_clip_low_high: [0.2, 0.28]\nbf16: true\n"
                    "rollout_batch_size: 32\ntrain_batch_size: 32\nplacement: {actor: '0', rollout: '0'}\n")
    c = config_of("--config", str(path))
    assert c.zero_stage == 3 and c.actor_learning_rate == 5e-7 and c.eps_clip_low_high == (0.2, 0.28) and c.bf16
    assert c.placement == {"actor": "0", "rollout": "0"}
    c = config_of("--config", str(path), "--zero_stage", "1", "--no_bf16", "--rollout_batch_size", "64")
    assert c.zero_stage == 1 and c.bf16 is False and c.rollout_batch_size == 64 and c.train_batch_size == 32
    assert isinstance(c, PPOConfig)


@pytest.mark.parametrize("text, field, fragment", [
    ("actor_learnig_rate: 1e-6\n", "actor_learnig_rate", "Did you mean actor_learning_rate?"),
    ("lora_rank: 8\n", "lora_rank", "does not support yet"),
    ("zero_stage: three\n", "zero_stage", "invalid value 'three'"),
    ("bf16: maybe\n", "bf16", "invalid value"),
    ("dry_run: true\n", "dry_run", "command-line option"),
    ("- a\n- b\n", "config", "must hold a mapping"),
    ("a: [\n", "config", "not valid YAML"),
])
def test_yaml_errors_name_the_key(tmp_path, text, field, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    e = error_of("--config", str(path))
    assert e.field == field and fragment in str(e)
    if field != "config":
        assert "bad.yaml" in str(e)


def test_yaml_missing_file():
    assert error_of("--config", "/no/such.yaml").field == "config"
