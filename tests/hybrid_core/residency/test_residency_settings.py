"""The residency section (hybrid_core.residency.settings): its checks name ``residency.<setting>``, through the
training config the flags; the sleep switches speak for roles by kind (no role named by core), as the flags did."""

import pytest

from hybrid_algos.train.config import PPOConfig
from hybrid_algos.train.sections import table_problems
from hybrid_core.errors import ConfigError
from hybrid_core.residency.settings import ResidencySettings

BAD = [
    (dict(mode="sometimes"), "residency.mode", "'sometimes' is not one of auto, all-sleep, manual"),
    (dict(pins={"actor.optimizer": "float"}), "residency.pins", "actor.optimizer=float is not ROLE.STATE=MOVE"),
    (dict(pins={"actor": "offload"}), "residency.pins", "is not ROLE.STATE=MOVE"),
    (dict(gpu_memory_gb=0), "residency.gpu_memory_gb", "must be > 0, got 0"),
    (dict(host_memory_gb=-1.0), "residency.host_memory_gb", "must be > 0, got -1.0"),
    (dict(gpu_context_gb=64), "residency.gpu_context_gb", "must be in [0, 64), got 64"),
    (dict(gpu_memory_usable=1.5), "residency.gpu_memory_usable", "must be in (0, 1], got 1.5"),
]
FLAGS = {
    "residency.mode": "residency",
    "residency.pins": "residency_pins",
    "residency.gpu_memory_gb": "gpu_memory_gb",
    "residency.host_memory_gb": "host_memory_gb",
    "residency.gpu_context_gb": "gpu_context_gb",
    "residency.gpu_memory_usable": "gpu_memory_usable",
    "residency.trainer_sleep": "deepspeed_enable_sleep",
}


@pytest.mark.parametrize("values, path, fragment", BAD)
def test_the_section_refuses_each_bad_value_naming_its_path(values, path, fragment):
    with pytest.raises(ConfigError) as err:
        ResidencySettings(**values).validate()
    assert err.value.field == path and fragment in err.value.problem and "--" not in str(err.value)


@pytest.mark.parametrize("values, path, fragment", BAD)
def test_through_the_config_the_same_error_names_the_flag(values, path, fragment):
    flag = FLAGS[path]
    with pytest.raises(ConfigError) as err:
        PPOConfig(**{flag: next(iter(values.values()))}).validate()
    assert err.value.field == flag and fragment in err.value.problem
    assert f"--{flag}" in (err.value.fix or "") or path not in (err.value.fix or "")
    assert "residency." not in str(err.value)


def test_sleeping_trainers_need_zero_1_to_3_given_by_the_trainer_section():
    ResidencySettings(trainer_sleep=True).validate()  # the stage unknown: not checked here
    ResidencySettings(mode="all-sleep").validate(zero_stage=1)
    with pytest.raises(ConfigError, match="only offload/reload its states with ZeRO 1-3") as err:
        ResidencySettings(trainer_sleep=True).validate(zero_stage=0)
    assert err.value.field == "residency.trainer_sleep" and "trainer.zero_stage 1, 2 or 3" in err.value.fix
    with pytest.raises(ConfigError) as err:
        PPOConfig(residency="all-sleep", zero_stage=0).validate()
    assert err.value.field == "residency" and err.value.fix == "Use --zero_stage 1, 2 or 3, or --residency auto."
    with pytest.raises(ConfigError) as err:
        PPOConfig(deepspeed_enable_sleep=True, zero_stage=0).validate()
    assert err.value.fix == "Use --zero_stage 1, 2 or 3, or drop --deepspeed_enable_sleep."


def test_the_sleep_switches_speak_for_roles_by_kind():
    kinds = {"policy": "trainer", "judge": "frozen", "samplers": "engine", "teacher": "frozen"}
    asks = ResidencySettings(trainer_sleep=True, frozen_sleep=True).sleep_asks(kinds, engine_sleep=None)
    assert asks.roles == {"policy", "judge", "teacher"} and asks.pins == {}
    assert asks.fields == {
        "policy": "residency.trainer_sleep",
        "judge": "residency.frozen_sleep",
        "teacher": "residency.frozen_sleep",
        "samplers": "engine.sleep",
    }
    off = ResidencySettings(trainer_sleep=False).sleep_asks(kinds, engine_sleep=False, engine_sleep_level=2)
    assert off.roles == frozenset()  # switched off: every state of those roles stays (the cache is the planner's)
    assert off.pins == {
        ("policy", "params"): "resident",
        ("policy", "grads"): "resident",
        ("policy", "optimizer"): "resident",
        ("samplers", "weights"): "resident",
        ("samplers", "kv_cache"): "resident",
    }
    level = ResidencySettings().sleep_asks(kinds, engine_sleep_level=2)  # a level with the planner on: how they go
    assert level.pins == {("samplers", "weights"): ("resident", "discard")}
    pins = ResidencySettings(pins={"policy.optimizer": "offload"}).state_pins()
    assert pins == {("policy", "optimizer"): "offload"}


def test_the_config_s_residency_is_the_section_and_the_table_knows_it():
    cfg = PPOConfig(residency="manual", host_memory_gb=100.0, residency_overlap=False, ref_reward_offload=True)
    section = cfg.residency_settings().validate(zero_stage=cfg.zero_stage)
    assert (section.mode, section.host_memory_gb, section.overlap, section.frozen_sleep) == (
        "manual",
        100.0,
        False,
        True,
    )
    assert [p for p in table_problems() if "residency" in p] == []
