"""The weight-sync section (``hybrid_engines.weight_sync.settings.SyncSettings``) checks its own settings in its own
words (``sync.<field>``), and so does the path chooser; the training config and the run's start say those errors in
the flags' words the user wrote -- the same text as before the section existed."""

from __future__ import annotations

import dataclasses

import pytest

from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.sections import TABLE, fields_of, flag_words, table_problems
from hybrid_core.errors import ConfigError
from hybrid_core.placement import PlacementSpec
from hybrid_engines.weight_sync import SyncSettings, choose_sync

#: (section values, the path it names, the flat config values, the flag's field, problem, fix as the user reads
#: them: the texts RLConfig.validate gave before the sync section took the checks over)
CASES = [
    (
        dict(bucket_mb=0),
        "sync.bucket_mb",
        dict(weight_sync_bucket_mb=0),
        "weight_sync_bucket_mb",
        "must be a positive integer, got 0.",
        "Give --weight_sync_bucket_mb a whole number >= 1.",
    ),
    (
        dict(transport="pigeon"),
        "sync.transport",
        dict(weight_sync="pigeon"),
        "weight_sync",
        "'pigeon' is not one of auto, ipc, broadcast.",
        "Use one of: auto, ipc, broadcast.",
    ),
    (
        dict(verify="sometimes"),
        "sync.verify",
        dict(verify_weight_sync="sometimes"),
        "verify_weight_sync",
        "'sometimes' is not one of sampled, full, off.",
        "Use one of: sampled, full, off.",
    ),
    (
        dict(group_backend="mpi"),
        "sync.group_backend",
        dict(vllm_sync_backend="mpi"),
        "vllm_sync_backend",
        "must be nccl or gloo, got 'mpi'.",
        "Use --vllm_sync_backend nccl on GPUs (gloo is picked by itself on CPU).",
    ),
]

SPLIT = PlacementSpec.from_ranges({"actor": "0", "rollout": "1"}).plan()
COLOCATED = PlacementSpec.from_ranges({"actor": "0-1", "rollout": "0-1"}, tp={"rollout": 2}).plan()


def _in_section_words(error: ConfigError) -> None:
    text = f"{error.problem} {error.fix}"
    assert "--" not in text and "vllm_" not in text and "weight_sync" not in text, text


@pytest.mark.parametrize(("values", "path"), [(c[0], c[1]) for c in CASES])
def test_the_section_refuses_each_bad_value_naming_its_setting(values, path):
    with pytest.raises(ConfigError) as e:
        SyncSettings(**values).validate()
    assert e.value.field == path
    _in_section_words(e.value)


@pytest.mark.parametrize(("flat", "field", "problem", "fix"), [c[2:] for c in CASES])
def test_the_config_says_the_same_error_in_its_flags_words(flat, field, problem, fix):
    with pytest.raises(ConfigError) as e:
        GRPOConfig(**flat).validate()
    assert (e.value.field, e.value.problem, e.value.fix) == (field, problem, fix)


def test_the_section_comes_from_every_flag_of_the_table():
    assert set(fields_of("sync")) == {f.name for f in dataclasses.fields(SyncSettings)}
    config = GRPOConfig(weight_sync="broadcast", weight_sync_bucket_mb=64, vllm_sync_backend="gloo").validate()
    assert config.sync_settings() == SyncSettings(bucket_mb=64, transport="broadcast", group_backend="gloo")
    assert config.sync_settings().bucket_bytes == 64 << 20
    # a config from before the verification modes: a bool, read as the default or off, before the section is built
    assert GRPOConfig(verify_weight_sync=False).validate().sync_settings().verify == "off"
    assert GRPOConfig(verify_weight_sync=True).validate().sync_settings().verify == "sampled"


def test_the_choosers_refusals_read_as_flags_where_the_run_starts():
    # the path chooser speaks the sections' words; the run's start (loop._prepare, the dry run) wraps it in
    # flag_words, so the user reads what they wrote
    with pytest.raises(ConfigError) as e:
        choose_sync(SyncSettings(transport="ipc"), "vllm", SPLIT)
    assert e.value.field == "sync.transport" and e.value.fix == "Use sync.transport broadcast (or auto)."
    with pytest.raises(ConfigError) as e, flag_words():
        choose_sync(SyncSettings(transport="ipc"), "vllm", SPLIT)
    assert e.value.field == "weight_sync" and e.value.fix == "Use --weight_sync broadcast (or auto)."
    with pytest.raises(ConfigError) as e, flag_words():
        choose_sync(SyncSettings(), "sglang", COLOCATED)  # SGLang's TP > 1 engines: its RayEngine, refused
    assert e.value.field == "backend" and e.value.problem.startswith("--backend sglang cannot run this placement: ")
    assert e.value.fix == "Use --backend vllm for this placement, or tensor-parallel size 1."


def test_the_table_rows_of_the_sync_section_are_sound():
    mine = {flat for flat, path in TABLE if path.startswith("sync.")}
    mine |= {path for flat, path in TABLE if path.startswith("sync.")}
    assert not [p for p in table_problems() if p.split(":")[0] in mine]
