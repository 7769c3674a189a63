"""The run and models sections: their own checks name ``run.*`` / ``models.*``; through the flat config the same
error names the flag."""

from __future__ import annotations

import dataclasses

import pytest

from hybrid_algos.train import sections
from hybrid_algos.train.config import PPOConfig, demo_config
from hybrid_algos.train.model_settings import ModelSettings
from hybrid_algos.train.run_settings import RunSettings
from hybrid_core.errors import ConfigError

RUN_BAD = [
    (dict(logging_steps=0), "logging_steps", "positive integer"),
    (dict(max_ckpt_num=-1), "max_ckpt_num", "positive integer"),
    (dict(ray_log_max_mb=True), "ray_log_max_mb", "positive integer"),
    (dict(profile_step=-2), "profile_step", "step number"),
    (dict(save_steps=0), "save_steps", "-1 (only the final save)"),
    (dict(resume=True, overwrite=True), "overwrite", "deletes the run"),
    (dict(resume=True, save_path="/no/such/run"), "resume", "/no/such/run/checkpoints"),
    (dict(call_timeout_s=float("inf")), "call_timeout_s", "finite number of seconds"),
    (dict(step_timeout_s=0.0), "step_timeout_s", "finite number of seconds"),
    (dict(address="ray://head:10001", num_gpus=2), "num_gpus", "ray://head:10001"),
]
MODEL_BAD = [
    (dict(task="sort"), "task", "'sort' is not one of"),
    (dict(task_length=0), "task_length", "positive integer"),
    (dict(pretrain="/no/such/model"), "pretrain", "no model folder"),
    (dict(critic_pretrain="/no/such/critic"), "critic_pretrain", "no model folder"),
    (dict(reward_fn="no_colon"), "reward_fn", "expected 'module:function'"),
    (dict(reward_fn="no_such_module_xyz:score"), "reward_fn", "cannot find module"),
    (dict(reward_random_head=True), "reward_random_head", "no reward model"),
]


@pytest.mark.parametrize("bad, name, says", RUN_BAD, ids=[b[1] for b in RUN_BAD])
def test_the_run_section_refuses_each_bad_value_by_its_path(bad, name, says):
    with pytest.raises(ConfigError) as e:
        RunSettings(**bad).validate()
    assert e.value.field == f"run.{name}" and says in e.value.problem, str(e.value)
    assert "--" not in e.value.problem + (e.value.fix or "")


@pytest.mark.parametrize("bad, name, says", MODEL_BAD, ids=[b[1] for b in MODEL_BAD])
def test_the_models_section_refuses_each_bad_value_by_its_path(bad, name, says):
    with pytest.raises(ConfigError) as e:
        ModelSettings(**bad).validate()
    assert e.value.field == f"models.{name}" and says in e.value.problem, str(e.value)
    assert "--" not in e.value.problem + (e.value.fix or "")


@pytest.mark.parametrize("bad, name, says", RUN_BAD + MODEL_BAD, ids=[b[1] for b in RUN_BAD + MODEL_BAD])
def test_through_the_config_the_same_error_names_the_flag(bad, name, says, tmp_path):
    bad = {"save_path": str(tmp_path), **bad}
    with pytest.raises(ConfigError) as e:
        demo_config(PPOConfig, **bad).validate()
    assert e.value.field == name and says in e.value.problem, str(e.value)
    assert "run." not in str(e.value) and "models." not in str(e.value), str(e.value)


def test_the_flag_words_are_todays():
    with pytest.raises(ConfigError) as e:
        demo_config(PPOConfig, resume=True, overwrite=True).validate()
    assert e.value.problem == "--overwrite deletes the run that --resume would continue."
    assert e.value.fix == "Keep one of them: --resume continues the run, --overwrite replaces it."
    with pytest.raises(ConfigError) as e:
        demo_config(PPOConfig, task="sort").validate()
    assert e.value.fix == "Or give your own prompts with --prompt_data FILE --input_key KEY."
    ModelSettings(task="sort").validate(builtin_prompts=False)  # with prompts of its own, a run has no task


def test_the_sections_come_from_the_flags():
    config = demo_config(PPOConfig, save_path="/tmp/x", ckpt_path=None, use_wandb="secret-key", task="reverse")
    run = config.run_settings()
    assert run.checkpoint_dir == config.checkpoint_dir == "/tmp/x/checkpoints"
    assert "secret-key" not in repr(run), "an API key never shows in a printed section"
    assert config.models_settings().task == "reverse"
    assert not RunSettings(save_steps=-1, final_checkpoint=False).saves_checkpoints
    assert RunSettings(save_steps=-1, final_checkpoint=False, resume_if_exists=True).saves_checkpoints


@pytest.mark.parametrize("name, cls", [("run", RunSettings), ("models", ModelSettings)])
def test_the_table_has_no_problem_with_the_section(name, cls):
    assert [p for p in sections.table_problems() if p.partition(":")[0].startswith(name + ".")] == []
    assert set(sections.fields_of(name)) == {f.name for f in dataclasses.fields(cls)}
