"""The engine section (``hybrid_engines.adapter.EngineSettings``) checks its own settings in its own words
(``engine.<field>``), the registry adds a registered backend and the adapter's refusals, and the training config says
every such error in the flags' words the user wrote -- the same text as before the section existed."""

from __future__ import annotations

import dataclasses

import pytest

from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.sections import TABLE, fields_of, table_problems
from hybrid_core.errors import ConfigError
from hybrid_engines.adapter import EngineSettings
from hybrid_engines.registry import engine_spec, validate_settings

#: (section values, the path the section names, the flat config values, the flag's field, problem, fix as the user
#: reads them: the texts RLConfig.validate gave before the engine section took the checks over)
CASES = [
    (
        dict(num_engines=-1),
        "engine.num_engines",
        dict(vllm_num_engines=-1),
        "vllm_num_engines",
        "must be a whole number >= 0, got -1.",
        "Give the number of engines; 0 puts a built-in engine on each actor GPU.",
    ),
    (
        dict(num_engines=True),
        "engine.num_engines",
        dict(vllm_num_engines=True),
        "vllm_num_engines",
        "must be a whole number >= 0, got True.",
        "Give the number of engines; 0 puts a built-in engine on each actor GPU.",
    ),
    (
        dict(tensor_parallel_size=0),
        "engine.tensor_parallel_size",
        dict(vllm_tensor_parallel_size=0),
        "vllm_tensor_parallel_size",
        "must be a positive integer, got 0.",
        "Give --vllm_tensor_parallel_size a whole number >= 1.",
    ),
    (
        dict(gpu_memory_utilization=1.5),
        "engine.gpu_memory_utilization",
        dict(vllm_gpu_memory_utilization=1.5),
        "vllm_gpu_memory_utilization",
        "must be in (0, 1], got 1.5.",
        "It is a fraction of the GPU, e.g. --vllm_gpu_memory_utilization 0.5.",
    ),
    (
        dict(gpu_memory_utilization=0),
        "engine.gpu_memory_utilization",
        dict(vllm_gpu_memory_utilization=0),
        "vllm_gpu_memory_utilization",
        "must be in (0, 1], got 0.",
        "It is a fraction of the GPU, e.g. --vllm_gpu_memory_utilization 0.5.",
    ),
    (
        dict(sleep_level=3),
        "engine.sleep_level",
        dict(engine_sleep_level=3),
        "engine_sleep_level",
        "must be 1 or 2, got 3.",
        "1 keeps the weights in host memory, 2 discards them; use --engine_sleep_level 1.",
    ),
]
#: what only the registry and the backend's adapter can refuse (validate_settings), in the same form
REGISTRY_CASES = [
    (
        dict(backend="pigeon"),
        "engine.backend",
        dict(backend="pigeon"),
        "backend",
        "'pigeon' is not one of hf, vllm, sglang.",
        "--backend hf runs anywhere; vllm/sglang need the extras.",
    ),
    (
        dict(backend="vllm", num_engines=0),
        "engine.num_engines",
        dict(backend="vllm", vllm_num_engines=0),
        "vllm_num_engines",
        "0 engines means generating on the actor's GPUs with the built-in engine, but --backend is vllm.",
        "Use --backend hf, or give --vllm_num_engines N for N separate engines.",
    ),
    (
        dict(backend="hf", tensor_parallel_size=2),
        "engine.tensor_parallel_size",
        dict(backend="hf", vllm_tensor_parallel_size=2),
        "vllm_tensor_parallel_size",
        "the built-in engine (--backend hf) runs on one GPU, but --vllm_tensor_parallel_size = 2.",
        "Use --vllm_tensor_parallel_size 1 with --backend hf, or --backend vllm / sglang.",
    ),
]


def _in_section_words(error: ConfigError) -> None:
    """An engine error names settings as engine.<field> (fields of the section), never as a CLI flag."""
    text = f"{error.problem} {error.fix}"
    assert "--" not in text and "vllm_" not in text, text
    fields = {f.name for f in dataclasses.fields(EngineSettings)}
    for word in text.split():
        if word.startswith("engine."):
            assert word.removeprefix("engine.").strip(".,;()") in fields, word


@pytest.mark.parametrize(("values", "path"), [(c[0], c[1]) for c in CASES])
def test_the_section_refuses_each_bad_value_naming_its_setting(values, path):
    with pytest.raises(ConfigError) as e:
        EngineSettings(**values).validate()
    assert e.value.field == path
    _in_section_words(e.value)


@pytest.mark.parametrize(("values", "path"), [(c[0], c[1]) for c in CASES + REGISTRY_CASES])
def test_the_registry_adds_the_backend_and_its_adapters_refusals(values, path):
    with pytest.raises(ConfigError) as e:
        validate_settings(EngineSettings(**values))
    assert e.value.field == path
    _in_section_words(e.value)


@pytest.mark.parametrize(("flat", "field", "problem", "fix"), [c[2:] for c in CASES + REGISTRY_CASES])
def test_the_config_says_the_same_error_in_its_flags_words(flat, field, problem, fix):
    with pytest.raises(ConfigError) as e:
        GRPOConfig(**flat).validate()
    assert (e.value.field, e.value.problem, e.value.fix) == (field, problem, fix)


def test_good_settings_pass_and_come_from_every_flag_of_the_table():
    settings = EngineSettings(backend="vllm", num_engines=2, tensor_parallel_size=2, sleep_level=2)
    assert validate_settings(settings) is settings and settings.validate() is settings
    # every field of the section comes from a flag: none is left at the section's own default by build()
    assert set(fields_of("engine")) == {f.name for f in dataclasses.fields(EngineSettings)}
    config = GRPOConfig(
        backend="vllm",
        vllm_num_engines=2,
        vllm_enable_sleep=True,
        engine_sleep_level=2,
        seeded_sampling=False,
        enable_prefix_caching=True,
    ).validate()
    engine = config.engine_settings()
    assert (engine.backend, engine.num_engines, engine.sleep, engine.sleep_level) == ("vllm", 2, True, 2)
    assert engine.seeded_sampling is False and engine.enable_prefix_caching is True


def test_seeding_defaults_to_where_the_engine_says_it_is_cheap():
    assert engine_spec("hf").seeds_samples(EngineSettings(backend="hf")) is True  # a seed per row costs nothing
    assert engine_spec("vllm").seeds_samples(EngineSettings(backend="vllm")) is False  # one request per sample
    assert engine_spec("vllm").seeds_samples(EngineSettings(backend="vllm", seeded_sampling=True)) is True
    assert engine_spec("hf").seeds_samples(EngineSettings(backend="hf", seeded_sampling=False)) is False


def test_the_table_rows_of_the_engine_section_are_sound():
    mine = {flat for flat, path in TABLE if path.startswith("engine.")}
    mine |= {path for flat, path in TABLE if path.startswith("engine.")}
    assert not [p for p in table_problems() if p.split(":")[0] in mine]
