"""Flags and --config files: types, switches, pairs, mappings, precedence, and errors that name the flag."""

import pytest

from hybrid_algos.train.config import DEMO_SETTINGS, GRPOConfig, PPOConfig, RLConfig
from hybrid_cli import openrlhf_flags as orl
from hybrid_cli.flags import field_specs
from hybrid_cli.main import load_config, main
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
    c = config_of(
        "--zero_stage",
        "3",
        "--bf16",
        "--actor_learning_rate",
        "5e-7",
        "--eps_clip_low_high",
        "0.2",
        "0.28",
        "--max_steps",
        "7",
        "--use_wandb",
        "KEY",
        "--placement",
        "actor=0-1",
        "rollout=0-1",
        "--tiny_model",
        "hidden_size=32",
        "num_hidden_layers=1",
        "--no_vllm_enable_sleep",
        "--deepspeed_enable_sleep",
        "--save_path",
        str(tmp_path),
    )
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


def test_demo_defaults_vs_openrlhf_defaults(tiny_model_dir):
    demo = config_of()
    assert demo.colocate_all_models and demo.vllm_enable_sleep is None and demo.backend == "hf"  # residency decides
    # an OpenRLHF command line (its own model + OpenRLHF placement): OpenRLHF's defaults for what it does not give
    openrlhf = [
        "--pretrain",
        tiny_model_dir,
        "--reward_pretrain",
        tiny_model_dir,
        "--actor_num_gpus_per_node",
        "2",
        "--vllm_num_engines",
        "2",
        "--ref_num_gpus_per_node",
        "2",
        "--critic_num_gpus_per_node",
        "2",
        "--reward_num_gpus_per_node",
        "2",
    ]
    config, _, notes = load_config("ppo", openrlhf)
    assert not config.colocate_all_models and config.vllm_enable_sleep is None and config.deepspeed_enable_sleep is None
    assert config.backend == "vllm" and config.train_batch_size == 128 and config.vllm_gpu_memory_utilization == 0.95
    assert config.micro_train_batch_size == 1 and config.bf16  # 0.11.2's parser defaults, read from the data file
    assert "OpenRLHF's defaults" in notes[0] and "backend=vllm" in notes[0]
    # the same flags on the demo (no --pretrain) keep hybrid's defaults, and say so
    config, _, notes = load_config(
        "ppo",
        [
            "--actor_num_gpus_per_node",
            "2",
            "--vllm_num_engines",
            "2",
            "--ref_num_gpus_per_node",
            "2",
            "--critic_num_gpus_per_node",
            "2",
        ],
    )
    assert config.colocate_all_models and config.backend == "hf"
    # the demo's step (64 samples) over the 2 actor GPUs asked for: micro-batches of 32 fill one step exactly
    assert config.train_batch_size == DEMO_SETTINGS["train_batch_size"] and config.actor_num_gpus_per_node == 2
    assert config.train_batch_size % (config.micro_train_batch_size * 2) == 0
    # ... and a demo whose micro-batch does not divide its step over 2 GPUs gets one that does
    config, _, _ = load_config("ppo", ["--actor_num_gpus_per_node", "2", "--train_batch_size", "32"])
    assert config.micro_train_batch_size == 16
    assert any("keeps hybrid's default" in n for n in notes)
    # turning colocation off on the demo: a valid split run (who sleeps is the residency plan's, nobody shares)
    config = config_of("--no_colocate_all_models")
    assert not config.colocate_all_models and config.vllm_enable_sleep is None
    # a dotted flag alone marks an OpenRLHF command line
    config, _, notes = load_config(
        "ppo",
        [
            "--actor.model_name_or_path",
            tiny_model_dir,
            "--reward_pretrain",
            tiny_model_dir,
            "--vllm.num_engines",
            "1",
            "--actor.num_gpus_per_node",
            "1",
            "--critic.num_gpus_per_node",
            "1",
            "--ref.num_gpus_per_node",
            "1",
            "--reward.num_gpus_per_node",
            "1",
            "--rollout.batch_size",
            "8",
            "--train.batch_size",
            "8",
        ],
    )
    assert not config.colocate_all_models and config.backend == "vllm" and config.rollout_batch_size == 8
    # explicit flags still win over OpenRLHF's defaults
    config = config_of(
        "--pretrain",
        tiny_model_dir,
        "--colocate_all_models",
        "--actor_num_gpus_per_node",
        "1",
        "--backend",
        "hf",
        "--ref_num_gpus_per_node",
        "1",
        "--critic_num_gpus_per_node",
        "1",
        "--rollout_batch_size",
        "8",
        "--train_batch_size",
        "8",
        "--reward_pretrain",
        tiny_model_dir,
    )
    assert config.colocate_all_models and config.backend == "hf" and config.rollout_batch_size == 8


@pytest.mark.parametrize(
    "argv, field, text",
    [
        (["--load_in_4bit"], "load_in_4bit", "--load_in_4bit is OpenRLHF-only: 4-bit (QLoRA)"),
        (["--ds.load_in_4bit"], "ds.load_in_4bit", "--ds.load_in_4bit is OpenRLHF-only: 4-bit (QLoRA)"),
        (["--ds.ring_attn_size", "2"], "ds.ring_attn_size", "OpenRLHF-only: ring attention"),
        (["--actor_learning_rte", "1e-6"], "actor_learning_rte", "Did you mean --actor_learning_rate?"),
        (["--train.colocate_al"], "train.colocate_al", "Did you mean --train.colocate_all?"),
        (["--colocate_all_model"], "colocate_all_model", "Did you mean --colocate_all_models?"),
        (["--zzz"], "zzz", "unknown flag --zzz"),
        (["--pre", "x"], "pre", "unknown flag"),  # no abbreviations
        (["--zero_stage", "three"], "zero_stage", "invalid"),
        (["--bf16", "true"], "arguments", "unexpected value(s) true"),
        (["-x"], "x", "two dashes"),
        (["--eps_clip_low_high", "0.2"], "eps_clip_low_high", "expected 2 arguments"),
        (["--placement", "actor"], "placement", "KEY=VALUE"),
    ],
)
def test_bad_flags_name_the_flag(argv, field, text):
    e = error_of(*argv)
    assert e.field == field and text in str(e)


def test_unknown_flag_exit_status_and_message(capsys):
    assert main(["ppo", "--load_in_4bit", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid: error: load_in_4bit:") and "--load_in_4bit" in err
    assert main(["pp0"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_every_refused_openrlhf_flag_is_reported_as_such():
    refused = [n for n in orl.openrlhf_flags() if orl.rule_for(n).kind == "refuse"]
    assert len(refused) > 20
    for name in refused:
        flag = orl.openrlhf_flags()[name]
        value = [] if flag.arity in (0, "*") else ["1"] * (2 if flag.arity == 2 else 1)
        e = error_of(f"--{name}", *value)
        assert e.field == name and "OpenRLHF-only" in str(e) and e.fix, name


def test_a_suggestion_never_turns_a_switch_around():
    e = error_of("--train.colocate_allx")
    assert "--train.colocate_all" in str(e) and "no_colocate" not in str(e)
    e = error_of("--colocate_all_modelz")
    assert "Did you mean --colocate_all_models?" in str(e)
    assert "no_" not in error_of("--vllm_enable_slep").fix
    assert "--no_vllm_enable_sleep" in error_of("--no_vllm_enable_slep").fix  # a no_ name may get a no_ switch


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
    path.write_text(
        "zero_stage: 3\nactor_learning_rate: 5e-7\neps_clip_low_high: [0.2, 0.28]\nbf16: true\n"
        "rollout_batch_size: 32\ntrain_batch_size: 32\nplacement: {actor: '0', rollout: '0'}\n"
    )
    c = config_of("--config", str(path))
    assert c.zero_stage == 3 and c.actor_learning_rate == 5e-7 and c.eps_clip_low_high == (0.2, 0.28) and c.bf16
    assert c.placement == {"actor": "0", "rollout": "0"}
    c = config_of("--config", str(path), "--zero_stage", "1", "--no_bf16", "--rollout_batch_size", "64")
    assert c.zero_stage == 1 and c.bf16 is False and c.rollout_batch_size == 64 and c.train_batch_size == 32
    assert isinstance(c, PPOConfig)


@pytest.mark.parametrize(
    "text, field, fragment",
    [
        ("actor_learnig_rate: 1e-6\n", "actor_learnig_rate", "Did you mean actor_learning_rate?"),
        ("load_in_4bit: true\n", "load_in_4bit", "OpenRLHF-only: 4-bit"),
        ("zero_stage: three\n", "zero_stage", "invalid value 'three'"),
        ("bf16: maybe\n", "bf16", "invalid value"),
        ("dry_run: true\n", "dry_run", "command-line option"),
        ("- a\n- b\n", "config", "must hold a mapping"),
        ("a: [\n", "config", "not valid YAML"),
    ],
)
def test_yaml_errors_name_the_key(tmp_path, text, field, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    e = error_of("--config", str(path))
    assert e.field == field and fragment in str(e)
    if field != "config":
        assert "bad.yaml" in str(e)


def test_yaml_missing_file():
    assert error_of("--config", "/no/such.yaml").field == "config"


@pytest.mark.parametrize(
    "argv",
    [
        ["--train.async_enable", "--train.async_queue_size", "2", "--train.partial_rollout_enable"],
        ["--async_train", "--async_queue_size", "2", "--partial_rollout"],  # OpenRLHF's flat spelling
    ],
)
def test_openrlhf_async_flags_map_to_asynchronous_training(argv):
    config = config_of(*argv)
    assert config.async_train and config.async_max_staleness == 2 and config.partial_rollout
    # hybrid's own names, and the default bound: one-step-off
    config = config_of("--async_train")
    assert config.async_train and config.async_max_staleness == 1 and not config.partial_rollout


def test_async_flags_that_cannot_work_are_refused_naming_the_flag():
    assert error_of("--partial_rollout").field == "partial_rollout"  # nothing to pause without --async_train
    assert error_of("--async_train", "--async_max_staleness", "0").field == "async_max_staleness"
    assert error_of("--async_train", "--no_enable_vllm_is_correction").field == "async_train"  # the off-policy gap


def test_dry_run_says_whether_an_async_run_overlaps(capsys):
    assert main(["grpo", "--async_train", "--dry-run"]) == 0
    assert "asynchronous on shared GPUs" in capsys.readouterr().out  # the demo fits: engine and trainer together
    assert main(["grpo", "--async_train", "--vllm_enable_sleep", "--dry-run"]) == 0
    assert "synchronous turns" in capsys.readouterr().out.replace("\n", " ")
