"""The rollout section: its own checks name ``rollout.*``; through the flat config the same error names the flag."""

from __future__ import annotations

import pytest

from hybrid_algos.train import sections
from hybrid_algos.train.config import GRPOConfig, PPOConfig, demo_config
from hybrid_algos.train.rollout_settings import AgentSettings, RolloutSettings
from hybrid_core.errors import ConfigError

# (bad values, the field the error names, words of its text); each alone on the demo's otherwise valid settings
BAD = [
    (dict(rollout_batch_size=0), "rollout_batch_size", "positive integer"),
    (dict(micro_rollout_batch_size=True), "micro_rollout_batch_size", "positive integer"),
    (dict(max_steps=0), "max_steps", "positive integer"),
    (dict(async_max_staleness=0), "async_max_staleness", "whole number >= 1"),
    (dict(temperature=-1.0), "temperature", "temperature=-1.0"),
    (dict(top_p=0.0), "top_p", "top_p=0.0"),
    (dict(top_k=0), "top_k", "top_k=0"),
    (dict(agent_timeout_s=float("inf")), "agent_timeout_s", "finite number of seconds"),
    (dict(agent_on_error="retry"), "agent_on_error", "'retry' is not one of raise, end_sample"),
    (dict(max_turns=0), "max_turns", "positive integer"),
    (dict(max_new_tokens_per_turn=2000, generate_max_len=1024), "max_new_tokens_per_turn", "generate_max_len = 1024"),
    (dict(rollout_batch_size=3, train_batch_size=2, micro_train_batch_size=1), "train_batch_size", "3 samples"),
    (dict(train_batch_size=16, micro_train_batch_size=3), "micro_train_batch_size", "3 x 1 = 3"),
    (dict(max_samples=4, rollout_batch_size=8, train_batch_size=8), "max_samples", "max_samples = 4"),
    (dict(prompt_data="no/such/file.jsonl", input_key="prompt"), "prompt_data", "no/such/file.jsonl"),
]


@pytest.mark.parametrize("bad, name, says", BAD, ids=[b[1] for b in BAD])
def test_the_section_refuses_each_bad_value_by_its_path(bad, name, says):
    with pytest.raises(ConfigError) as e:
        RolloutSettings(**bad).validate()
    field = e.value.field
    # the data reader's own error (check_prompt_sources) keeps its flat name: it also runs outside validate
    assert field == (name if name == "prompt_data" else f"rollout.{name}"), field
    assert says in e.value.problem, e.value.problem
    assert "--" not in e.value.problem + (e.value.fix or "") or name == "prompt_data"


@pytest.mark.parametrize("bad, name, says", BAD, ids=[b[1] for b in BAD])
def test_through_the_config_the_same_error_names_the_flag(bad, name, says):
    with pytest.raises(ConfigError) as e:
        PPOConfig(**bad).validate()
    assert e.value.field == name and says in e.value.problem
    assert "rollout." not in str(e.value), str(e.value)


def test_checks_that_need_another_section_take_it_as_an_argument():
    # GRPO compares the samples of a prompt: one sample each is refused, and the estimator is named
    with pytest.raises(ConfigError, match="group_norm compares samples") as e:
        RolloutSettings(n_samples_per_prompt=1).validate(grouped_estimator="group_norm")
    assert e.value.field == "rollout.n_samples_per_prompt"
    RolloutSettings(n_samples_per_prompt=1).validate()  # no grouped estimator: fine
    # a train batch splits over the actor's GPUs
    with pytest.raises(ConfigError, match="8 x 4 = 32") as e:
        RolloutSettings(train_batch_size=16, micro_train_batch_size=8).validate(actor_gpus=4)
    # an asynchronous run needs the mismatch correction
    with pytest.raises(ConfigError, match="mismatch") as e:
        RolloutSettings(async_train=True).validate(corrected=False)
    assert e.value.field == "rollout.async_train" and "rollout.async_train" in (e.value.fix or "")
    RolloutSettings(async_train=True).validate(corrected=True)
    # and through the config: the flags
    with pytest.raises(ConfigError, match="--async_train") as e:
        GRPOConfig(async_train=True, enable_vllm_is_correction=False).validate()
    assert e.value.field == "async_train"
    with pytest.raises(ConfigError) as e:
        GRPOConfig(n_samples_per_prompt=1).validate()
    assert e.value.field == "n_samples_per_prompt" and "--n_samples_per_prompt 4" in (e.value.fix or "")


def test_the_config_builds_the_section_from_its_flags_and_delegates_what_moved():
    config = demo_config(GRPOConfig, n_samples_per_prompt=4, rollout_batch_size=4, train_batch_size=8, seed=7)
    rollout = config.rollout_settings()
    assert (rollout.rollout_batch_size, rollout.n_samples_per_prompt, rollout.seed) == (4, 4, 7)
    assert rollout.samples_per_step == config.samples_per_step == 16
    assert rollout.single_update is config.single_update is False
    assert RolloutSettings(rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8).single_update


def test_agent_limits_have_one_home():
    # the built-in lookup task's own limits, else 8 turns of whatever the response leaves; the settings win
    assert RolloutSettings().agent_settings(builtin=True) == AgentSettings(2, 2, 60.0, "raise")
    assert RolloutSettings().agent_settings(builtin=False) == AgentSettings(8, None, 60.0, "raise")
    given = RolloutSettings(max_turns=3, max_new_tokens_per_turn=5, agent_timeout_s=9.0, agent_on_error="end_sample")
    assert given.agent_settings(builtin=True) == AgentSettings(3, 5, 9.0, "end_sample")


def test_the_table_has_no_problem_with_the_rollout_section():
    problems = [p for p in sections.table_problems() if "rollout." in p]
    assert problems == []
    assert set(sections.fields_of("rollout")) == {f.name for f in __import__("dataclasses").fields(RolloutSettings)}, (
        "every rollout setting comes from a flag"
    )
