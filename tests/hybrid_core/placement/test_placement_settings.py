"""The placement section (hybrid_core.placement.settings): its checks name ``placement.<setting>``; through the
training config the same errors name the flags (``--actor_num_gpus_per_node``), and the section table knows every
setting."""

import pytest

from hybrid_algos.train.config import GRPOConfig, PPOConfig
from hybrid_algos.train.sections import table_problems
from hybrid_core.errors import ConfigError
from hybrid_core.placement.settings import PlacementSettings

BAD = [
    (dict(actor_num_nodes=0), "placement.actor_num_nodes", "must be a positive integer, got 0"),
    (dict(actor_num_gpus_per_node=True), "placement.actor_num_gpus_per_node", "got True"),
    (dict(colocate_all="yes"), "placement.colocate_all", "expected true or false, got 'yes'"),
    (dict(colocate_actor_ref=1), "placement.colocate_actor_ref", "expected true or false"),
    (dict(colocate_critic_reward=None), "placement.colocate_critic_reward", "expected true or false"),
]
#: section path -> the flag the user writes
FLAGS = {
    "placement.actor_num_nodes": "actor_num_nodes",
    "placement.actor_num_gpus_per_node": "actor_num_gpus_per_node",
    "placement.colocate_all": "colocate_all_models",
    "placement.colocate_actor_ref": "colocate_actor_ref",
    "placement.colocate_critic_reward": "colocate_critic_reward",
}


@pytest.mark.parametrize("values, path, fragment", BAD)
def test_the_section_refuses_each_bad_value_naming_its_path(values, path, fragment):
    with pytest.raises(ConfigError) as err:
        PlacementSettings(**values).validate()
    assert err.value.field == path and fragment in err.value.problem
    assert path in err.value.fix and "--" not in str(err.value)


@pytest.mark.parametrize("values, path, fragment", BAD)
def test_through_the_config_the_same_error_names_the_flag(values, path, fragment):
    flag = FLAGS[path]
    with pytest.raises(ConfigError) as err:
        PPOConfig(**{flag: next(iter(values.values()))}).validate()
    assert err.value.field == flag and fragment in err.value.problem
    assert f"--{flag}" in err.value.fix and path not in str(err.value)


def test_the_config_s_placement_is_the_section_and_the_table_knows_it():
    cfg = GRPOConfig(actor_num_nodes=2, actor_num_gpus_per_node=4, colocate_all_models=False, gpus_per_node=8)
    section = cfg.placement_settings().validate()
    assert (section.count("actor"), section.colocate_all, section.gpus_per_node) == ((2, 4), False, 8)
    assert cfg.actor_world_size == section.world_size("actor") == 8
    assert PlacementSettings(**{"ranges": {"actor": "0-1"}}).ranges == {"actor": "0-1"}
    assert [p for p in table_problems() if p.startswith("placement.") or "placement" in p] == []
