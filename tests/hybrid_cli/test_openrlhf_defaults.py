"""An OpenRLHF command line runs OpenRLHF's algorithm: every setting it leaves out takes OpenRLHF's default for the
release it is read as (dotted: 0.11.2, flat: 0.10.1), under ``hybrid ppo`` and ``hybrid grpo`` alike; where hybrid
differs on purpose, the first notes of the run say so.

The table below is facts, not code: which OpenRLHF flag (in each spelling) is which setting here, and what its value
means. The defaults themselves come from OpenRLHF's parsers as data (hybrid_cli/data/openrlhf_defaults_<release>.json,
read from the wheels by packages/hybrid-cli/tools/extract_openrlhf_flags.py); each row compares the resolved config's
field with what that default means, for a dotted and a flat line, under both subcommands."""

from __future__ import annotations

import re

import pytest

from hybrid_algos.train.config import GRPOConfig, PPOConfig
from hybrid_cli import openrlhf_flags as orl
from hybrid_cli.flags import field_specs
from hybrid_cli.main import load_config

DOTTED, FLAT = "0.11.2", "0.10.1"


def same(default, config):
    return default


def none_is(value):
    return lambda default, config: value if default is None else default


def as_pair(default, config):
    return None if default is None else tuple(float(v) for v in default)


def off_when_not_given(default, config):  # read only when its switch is on; the lines here leave it off
    return None


#: field -> (0.11.2's flag, 0.10.1's flag, what OpenRLHF's default means here). None: the release has no such flag.
TABLE = {
    "ref_num_nodes": ("ref.num_nodes", "ref_num_nodes", same),
    "ref_num_gpus_per_node": ("ref.num_gpus_per_node", "ref_num_gpus_per_node", same),
    "reward_num_nodes": ("reward.num_nodes", "reward_num_nodes", same),
    "reward_num_gpus_per_node": ("reward.num_gpus_per_node", "reward_num_gpus_per_node", same),
    "actor_num_nodes": ("actor.num_nodes", "actor_num_nodes", same),
    "actor_num_gpus_per_node": ("actor.num_gpus_per_node", "actor_num_gpus_per_node", same),
    "critic_num_nodes": ("critic.num_nodes", "critic_num_nodes", same),
    "critic_num_gpus_per_node": ("critic.num_gpus_per_node", "critic_num_gpus_per_node", same),
    "colocate_actor_ref": ("train.colocate_actor_ref", "colocate_actor_ref", same),
    "colocate_critic_reward": ("train.colocate_critic_reward", "colocate_critic_reward", same),
    "colocate_all_models": ("train.colocate_all", "colocate_all_models", same),
    "vllm_num_engines": ("vllm.num_engines", "vllm_num_engines", none_is(0)),  # no engines: the actor generates
    "vllm_tensor_parallel_size": ("vllm.tensor_parallel_size", "vllm_tensor_parallel_size", same),
    "enable_prefix_caching": ("vllm.enable_prefix_caching", "enable_prefix_caching", same),
    "enforce_eager": ("vllm.enforce_eager", "enforce_eager", same),
    "vllm_gpu_memory_utilization": ("vllm.gpu_memory_utilization", "vllm_gpu_memory_utilization", same),
    "enable_vllm_is_correction": (
        "algo.advantage.is_correction_level",
        "enable_vllm_is_correction",
        lambda d, c: d not in ("off", False),
    ),
    "vllm_is_correction_type": (
        "algo.advantage.is_correction_mode",
        "vllm_is_correction_type",
        lambda d, c: "tis",
    ),  # no correction: the type is not read (0.10.1: tis)
    "vllm_is_truncated_threshold": (
        "algo.advantage.is_correction_threshold",
        "vllm_is_truncated_threshold",
        off_when_not_given,
    ),
    "async_train": ("train.async_enable", "async_train", same),
    "async_max_staleness": ("train.async_queue_size", "async_queue_size", same),
    "partial_rollout": ("train.partial_rollout_enable", "partial_rollout", same),
    "save_steps": ("ckpt.save_steps", "save_steps", same),
    "logging_steps": ("logger.logging_steps", "logging_steps", same),
    "save_hf_ckpt": ("ckpt.save_hf", "save_hf_ckpt", same),
    "max_ckpt_num": ("ckpt.max_num", "max_ckpt_num", same),
    "resume_if_exists": ("ckpt.load_enable", "load_checkpoint", same),
    "save_path": ("ckpt.output_dir", "save_path", same),
    "zero_stage": ("ds.zero_stage", "zero_stage", same),
    "gradient_checkpointing": ("actor.gradient_checkpointing_enable", "gradient_checkpointing", same),
    "bf16": ("ds.param_dtype", "param_dtype", lambda d, c: d == "bf16"),
    "adam_offload": ("ds.adam_offload", "adam_offload", same),
    "flash_attn": ("ds.attn_implementation", "attn_implementation", lambda d, c: d.startswith("flash_attention")),
    "packing_samples": ("ds.packing_samples", "packing_samples", same),
    "use_dynamic_batch": ("train.dynamic_batch_enable", "use_dynamic_batch", same),
    "train_max_tokens_per_gpu": ("train.max_tokens_per_gpu", "train_max_tokens_per_gpu", off_when_not_given),
    "rollout_max_tokens_per_gpu": ("rollout.max_tokens_per_gpu", "rollout_max_tokens_per_gpu", off_when_not_given),
    "num_episodes": ("train.num_episodes", "num_episodes", same),
    "rollout_batch_size": ("rollout.batch_size", "rollout_batch_size", same),
    "micro_rollout_batch_size": ("rollout.micro_batch_size", "micro_rollout_batch_size", same),
    "max_epochs": ("train.max_epochs", "max_epochs", same),
    # OpenRLHF's total length (prompt + completion): the two limits here add up to it
    "prompt_max_len": ("data.max_len", "max_len", lambda d, c: d - c.generate_max_len),
    "generate_max_len": ("rollout.max_new_tokens", "max_new_tokens", lambda d, c: c.generate_max_len),
    "max_samples": ("data.max_samples", "max_samples", same),
    "eps_clip": ("actor.eps_clip", "eps_clip", same),
    "eps_clip_low_high": ("actor.eps_clip_low_high", "eps_clip_low_high", as_pair),
    "dual_clip": ("actor.dual_clip", "dual_clip", same),
    "value_clip": ("critic.value_clip", "value_clip", same),
    "lambd": ("algo.advantage.lambd", "lambd", same),
    "gamma": ("algo.advantage.gamma", "gamma", same),
    "micro_train_batch_size": ("train.micro_batch_size", "micro_train_batch_size", same),
    "train_batch_size": ("train.batch_size", "train_batch_size", same),
    "normalize_reward": ("reward.normalize_enable", "normalize_reward", same),
    "top_p": ("rollout.top_p", "top_p", same),
    "temperature": ("rollout.temperature", "temperature", same),
    "seed": ("train.seed", "seed", same),
    "kl_target": ("algo.kl.target", "kl_target", same),
    "kl_horizon": ("algo.kl.horizon", "kl_horizon", same),
    "init_kl_coef": ("algo.kl.init_coef", "init_kl_coef", same),
    "policy_loss_type": ("actor.policy_loss_type", "policy_loss_type", same),
    "loss_agg_mode": ("actor.loss_agg_mode", None, same),
    "kl_estimator": ("algo.kl.estimator", "kl_estimator", same),
    "use_kl_loss": ("algo.kl.use_loss", "use_kl_loss", same),
    "entropy_loss_coef": ("actor.entropy_coef", "entropy_loss_coef", none_is(0.0)),  # None: no entropy term
    "reward_clip_range": ("reward.clip_range", "reward_clip_range", as_pair),
    "actor_learning_rate": ("actor.adam.lr", "actor_learning_rate", same),
    "critic_learning_rate": ("critic.adam.lr", "critic_learning_rate", same),
    "adam_betas": ("actor.adam.betas", "adam_betas", as_pair),
    "l2": ("actor.adam.weight_decay", "l2", same),
    "lr_scheduler": ("actor.lr_scheduler", "lr_scheduler", same),
    "lr_warmup_ratio": ("actor.lr_warmup_ratio", "lr_warmup_ratio", same),
    "min_lr_ratio": ("actor.min_lr_ratio", None, same),
    "max_norm": ("actor.max_norm", "max_norm", same),
    "advantage_estimator": ("algo.advantage.estimator", "advantage_estimator", same),
    "overlong_buffer_len": ("reward.overlong_buffer_len", "overlong_buffer_len", same),
    "overlong_penalty_factor": ("reward.overlong_penalty_factor", "overlong_penalty_factor", same),
    "critic_pretrain": ("critic.model_name_or_path", "critic_pretrain", same),
    "reward_pretrain": ("reward.model_name_or_path", "reward_pretrain", same),
    "reward_fn": ("reward.remote_url", "remote_rm_url", same),
    "ref_reward_offload": ("ref.offload", "ref_reward_offload", same),
    "agent_func_path": ("train.agent_func_path", "agent_func_path", same),
    "prompt_data": ("data.prompt_dataset", "prompt_data", same),
    "prompt_data_probs": ("data.prompt_probs", "prompt_data_probs", same),
    "prompt_split": ("data.prompt_split", "prompt_split", same),
    "input_key": ("data.input_key", "input_key", same),
    "label_key": ("data.label_key", "label_key", same),
    "input_template": ("data.input_template", "input_template", same),
    "apply_chat_template": ("data.apply_chat_template", "apply_chat_template", same),
    "image_key": ("data.image_key", "image_key", same),
    "max_images_per_prompt": ("data.max_images_per_prompt", "max_images_per_prompt", same),
    "lora_rank": ("ds.lora.rank", "lora_rank", same),
    "lora_alpha": ("ds.lora.alpha", "lora_alpha", same),
    "lora_dropout": ("ds.lora.dropout", "lora_dropout", same),
    "lora_target_modules": ("ds.lora.target_modules", "target_modules", same),
    "eval_dataset": ("eval.dataset", "eval_dataset", same),
    "eval_steps": ("eval.steps", "eval_steps", same),
    "eval_split": ("eval.split", "eval_split", same),
    "eval_temperature": ("eval.temperature", "eval_temperature", same),
    "eval_n_samples_per_prompt": ("eval.n_samples_per_prompt", "eval_n_samples_per_prompt", same),
    "use_wandb": ("logger.wandb.key", "use_wandb", same),
    "wandb_project": ("logger.wandb.project", "wandb_project", same),
    "dynamic_filtering": ("algo.dynamic_filtering_enable", "dynamic_filtering", same),
    "dynamic_filtering_reward_range": (
        "algo.dynamic_filtering_range",
        "dynamic_filtering_reward_range",
        off_when_not_given,
    ),
    "use_tensorboard": ("logger.tensorboard_dir", "use_tensorboard", lambda d, c: d is not None),
}
#: Settings that keep hybrid's meaning, each said in a note: field -> (0.11.2's flag, 0.10.1's flag).
DIFFERENT = {
    "vllm_enable_sleep": ("vllm.enable_sleep", "vllm_enable_sleep"),
    "deepspeed_enable_sleep": ("ds.enable_sleep", "deepspeed_enable_sleep"),
    "ckpt_path": ("ckpt.path", "ckpt_path"),
}
#: Flags the table does not compare, and why: field -> (0.11.2's flag, 0.10.1's flag).
ELSEWHERE = {
    "pretrain": ("actor.model_name_or_path", "pretrain"),  # the lines give it
    "n_samples_per_prompt": ("rollout.n_samples_per_prompt", "n_samples_per_prompt"),  # given (and tested below)
    "wandb_run_name": ("logger.wandb.run_name", "wandb_run_name"),  # the launch time: RUN_NAME
    "ref_reward_offload": ("reward.offload", "ref_reward_offload"),  # one setting for --ref.offload and this
}
#: The launch time, OpenRLHF's run name (strftime "ppo_%m%dT%H:%M").
RUN_NAME = re.compile(r"ppo_\d{4}T\d{2}:\d{2}")


@pytest.fixture(scope="module")
def lines(tiny_model_dir):
    """The smallest OpenRLHF line of each spelling (a model; the flat one also places the actor, at OpenRLHF's
    default). GRPO compares the samples of a prompt, so both give 2 per prompt (OpenRLHF asserts it too)."""
    return {
        DOTTED: ["--actor.model_name_or_path", tiny_model_dir, "--rollout.n_samples_per_prompt", "2"],
        FLAT: ["--pretrain", tiny_model_dir, "--actor_num_gpus_per_node", "8", "--n_samples_per_prompt", "2"],
    }


CASES = [
    pytest.param(release, command, id=f"{release}-{command}")
    for release in (DOTTED, FLAT)
    for command in ("ppo", "grpo")
]


@pytest.mark.parametrize("release, command", CASES)
def test_every_setting_left_out_takes_openrlhf_s_default(release, command, lines):
    config, _, notes = load_config(command, lines[release])
    defaults = orl.release_defaults(release)
    column = 0 if release == DOTTED else 1
    given = {"pretrain", "n_samples_per_prompt", "actor_num_gpus_per_node"}
    checked = []
    for field, row in TABLE.items():
        flag, meaning = row[column], row[2]
        if flag is None:
            continue
        if field == "advantage_estimator" and command == "grpo":
            assert config.advantage_estimator == "group_norm"  # the subcommand names the algorithm, and says so
            assert any(
                n.startswith(f"differs from OpenRLHF {release}: --{flag} not given: OpenRLHF gae") for n in notes
            )
            continue
        assert getattr(config, field) == meaning(defaults[flag], config), (release, command, field, flag)
        checked.append(field)
    assert config.wandb_run_name and RUN_NAME.fullmatch(config.wandb_run_name)
    assert len(checked) > 80
    # the bugs of issue 34: hybrid grpo's / ppo's own hyperparameters on an OpenRLHF line
    assert (config.kl_estimator, config.use_kl_loss, config.init_kl_coef) == ("k1", False, 0.01)
    assert (config.lambd, config.value_clip, config.lr_warmup_ratio) == (1, 0.5, 0.03)
    assert not config.enable_vllm_is_correction
    # the deliberate differences: hybrid's meaning, each named in the first notes (after the one on the defaults)
    cls = {"ppo": PPOConfig, "grpo": GRPOConfig}[command]
    assert f"OpenRLHF {release}" in notes[0] and "OpenRLHF's defaults" in notes[0]
    differences = [n for n in notes if n.startswith("differs from OpenRLHF")]
    assert notes[1 : 1 + len(differences)] == differences
    for field, flags in DIFFERENT.items():
        assert getattr(config, field) == field_specs(cls)[field].default, field
        flag = flags[column]
        note = next(n for n in differences if f" --{flag} not given: " in n)
        assert f"OpenRLHF {defaults[flag]}" in note and "Why: " in note
    assert given <= set(field_specs(cls))
    if release == DOTTED and command == "ppo":  # OpenRLHF's one sample per prompt, where PPO allows it
        assert (
            load_config("ppo", lines[release][:2])[0].n_samples_per_prompt == defaults["rollout.n_samples_per_prompt"]
        )


@pytest.mark.parametrize("release", [DOTTED, FLAT])
def test_the_table_covers_every_flag_that_maps_to_a_setting(release):
    """A flag of the release that sets something here is in the table (or a listed difference): a new mapping
    cannot skip OpenRLHF's default unnoticed."""
    column = 0 if release == DOTTED else 1
    listed = {row[column] for table in (TABLE, DIFFERENT, ELSEWHERE) for row in table.values()}
    specs = field_specs(PPOConfig)
    mapped = set()
    for name in orl.release_defaults(release):
        rule = orl.rule_for(name)
        fields = (rule.field,) if rule.kind in ("same", "pending") else rule.fields if rule.kind == "convert" else ()
        if any(f in specs for f in fields):
            mapped.add(name)
    # the critic's optimizer settings are the actor's here (one optimizer setting each), and 0.10.1's sync backend is
    # hybrid's own default where it is nccl
    shared = {
        n
        for n in mapped
        if n.startswith("critic.")
        and n.split(".", 1)[1]
        in ("adam.betas", "adam.weight_decay", "lr_scheduler", "lr_warmup_ratio", "min_lr_ratio", "max_norm")
    }
    sync = {"vllm.sync_backend", "vllm_sync_backend"}
    assert mapped - listed - shared - sync == set()


def test_openrlhf_s_correction_flags_mean_what_they_mean_there(tiny_model_dir):
    line = ["--actor.model_name_or_path", tiny_model_dir, "--rollout.n_samples_per_prompt", "2"]

    def config_of(*argv, command="ppo"):
        return load_config(command, [*line, *argv])[0]

    # --algo.advantage.is_correction_level off: no correction (it was dropped, leaving hybrid's own on)
    assert not config_of("--algo.advantage.is_correction_level", "off").enable_vllm_is_correction
    # token + clip is TIS, with OpenRLHF's bounds whether they are given or left at their default
    for extra in ((), ("--algo.advantage.is_correction_threshold", "0.5", "5.0")):
        c = config_of(
            "--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip", *extra
        )
        assert c.enable_vllm_is_correction and c.correction_type == "tis" and c.correction_bounds == (0.5, 5.0)
    c = config_of("--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_threshold", "3")
    assert c.correction_type == "icepop" and c.correction_bounds == (0.0, 3.0)  # mode mask by default; HIGH alone
    # the main branch's spelling (its README and example scripts)
    c = config_of("--algo.advantage.is_correction_enable", command="grpo")
    assert c.enable_vllm_is_correction and c.correction_type == "tis" and c.correction_bounds == (0.5, 5.0)
    c = config_of("--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "icepop")
    assert c.correction_type == "icepop" and c.correction_bounds == (0.5, 5.0)
    # the flat era's switch on a flat line takes 0.10.1's bounds too
    c, _, _ = load_config(
        "ppo", ["--pretrain", tiny_model_dir, "--actor_num_gpus_per_node", "8", "--enable_vllm_is_correction"]
    )
    assert c.enable_vllm_is_correction and c.correction_bounds == (0.5, 5.0)
    # asynchronous training keeps hybrid's correction on, and says so (OpenRLHF: off unless asked)
    c, _, notes = load_config("ppo", [*line, "--train.async_enable", "--train.partial_rollout_enable"])
    assert c.async_train and c.partial_rollout and c.enable_vllm_is_correction
    assert any(n.startswith("differs from OpenRLHF 0.11.2: --algo.advantage.is_correction_level") for n in notes)


def test_given_flags_win_and_hybrid_s_own_lines_keep_hybrid_s_defaults(tiny_model_dir):
    c = load_config(
        "grpo",
        [
            "--actor.model_name_or_path",
            tiny_model_dir,
            "--rollout.n_samples_per_prompt",
            "4",
            "--algo.kl.estimator",
            "k3",
            "--algo.kl.use_loss",
            "--init_kl_coef",
            "0.001",
            "--actor.lr_warmup_ratio",
            "0",
        ],
    )[0]
    assert (c.kl_estimator, c.use_kl_loss, c.init_kl_coef, c.lr_warmup_ratio) == ("k3", True, 0.001, 0.0)
    # GRPO compares a prompt's samples: OpenRLHF's one per prompt is refused, naming the setting (OpenRLHF asserts)
    from hybrid_core.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config("grpo", ["--actor.model_name_or_path", tiny_model_dir])
    assert e.value.field == "n_samples_per_prompt"
    # not an OpenRLHF line (a model of one's own, no OpenRLHF placement): hybrid grpo's own hyperparameters
    c = load_config("grpo", ["--pretrain", tiny_model_dir])[0]
    assert (c.kl_estimator, c.use_kl_loss, c.init_kl_coef, c.n_samples_per_prompt) == ("k3", True, 0.001, 8)
    assert c.enable_vllm_is_correction and c.colocate_all_models
    c = load_config("ppo", ["--pretrain", tiny_model_dir])[0]
    assert (c.lambd, c.value_clip, c.lr_warmup_ratio) == (0.95, 0.2, 0.0)


def test_the_data_files_are_openrlhf_s_parsers():
    data = orl.load_data()
    assert re.fullmatch(r"[0-9a-f]{40}", data["main_commit"])
    assert {f["name"] for f in data["main_flags"]} == {
        "algo.advantage.is_correction_enable",
        "algo.advantage.is_correction_type",
    }
    dotted, flat = orl.release_defaults(DOTTED), orl.release_defaults(FLAT)
    assert set(dotted) == {f["name"] for f in data["flags"]}
    assert (dotted["algo.kl.estimator"], dotted["algo.kl.use_loss"], dotted["algo.kl.init_coef"]) == ("k1", False, 0.01)
    assert (dotted["critic.value_clip"], dotted["algo.advantage.lambd"], dotted["actor.lr_warmup_ratio"]) == (
        0.5,
        1,
        0.03,
    )
    assert dotted["algo.advantage.is_correction_level"] == "off" and flat["enable_vllm_is_correction"] is False
    assert flat["max_len"] == 2048 and "prompt_max_len" not in flat and "actor.adam.lr" not in flat
    with pytest.raises(ValueError, match="no defaults recorded"):
        orl.release_defaults("0.9.10")
