"""--reward_pretrain needs a reward head in its weights: a causal-LM folder (no ``score.weight``) would be loaded as a
sequence classifier with a randomly initialised head, and its rewards would be noise. Real tiny folders saved from
configs; the check reads only config.json and the weight files' headers or index, before Ray (``prepare``)."""

import pytest
import torch
from transformers import LlamaForSequenceClassification

from hybrid_algos.train.config import PPOConfig
from hybrid_algos.train.loop import prepare
from hybrid_algos.train.model_files import check_reward_head, checkpoint_tensor_names
from hybrid_algos.train.tiny import build_tiny_tokenizer, save_tiny_model, tiny_model_config
from hybrid_core.errors import ConfigError


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("models") / "policy"))  # LlamaForCausalLM + tokenizer


def _save_reward_model(path, **save_kwargs):
    torch.manual_seed(1)
    LlamaForSequenceClassification(tiny_model_config(num_labels=1)).save_pretrained(path, **save_kwargs)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return _save_reward_model(tmp_path_factory.mktemp("models") / "reward")


def test_a_causal_lm_folder_is_refused_naming_the_missing_head_and_the_fix(causal_lm):
    with pytest.raises(ConfigError) as e:
        check_reward_head(causal_lm, random_head=False, trust_remote_code=False)
    message = str(e.value)
    assert e.value.field == "reward_pretrain"
    assert f"{causal_lm} holds a causal LM (LlamaForCausalLM)" in message
    assert "score.weight missing; it has lm_head.weight" in message
    assert "--reward_random_head" in e.value.fix and "--reward_fn" in e.value.fix


def test_a_sequence_classification_folder_is_accepted(reward_model, tmp_path):
    assert check_reward_head(reward_model, random_head=False, trust_remote_code=False) is None
    # sharded weights: the names come from the index file, no shard is opened
    sharded = _save_reward_model(tmp_path / "sharded", max_shard_size="100KB")
    assert checkpoint_tensor_names(sharded) == checkpoint_tensor_names(reward_model)
    assert check_reward_head(sharded, random_head=False, trust_remote_code=False) is None


def test_the_explicit_flag_accepts_a_random_head_and_says_so(causal_lm, reward_model):
    note = check_reward_head(causal_lm, random_head=True, trust_remote_code=False)
    assert note.startswith("--reward_random_head: ") and "score.weight missing" in note and "noise" in note
    # the flag on a folder that has its head is not silently ignored
    note = check_reward_head(reward_model, random_head=True, trust_remote_code=False)
    assert "not used" in note and "score.weight" in note


def test_prepare_refuses_before_ray_and_takes_the_flag(causal_lm, tmp_path):
    import ray

    config = PPOConfig(reward_pretrain=causal_lm, save_path=str(tmp_path / "run"), max_steps=1)
    with pytest.raises(ConfigError, match="no reward head"):
        prepare(config)
    assert not ray.is_initialized() and not (tmp_path / "run").exists()  # nothing started, nothing written
    prep = prepare(config.replace(reward_random_head=True))
    assert any(line.startswith("note: --reward_random_head: ") for line in prep.start_lines)


def test_the_flag_without_a_reward_model_is_refused():
    with pytest.raises(ConfigError) as e:
        PPOConfig(reward_random_head=True).validate()
    assert e.value.field == "reward_random_head"
