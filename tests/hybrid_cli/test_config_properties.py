"""Property tests of config parsing: whatever the flags or the YAML file hold, the result is a config whose values
are the ones given, or a ConfigError naming a real setting -- never another exception, never a silent change."""

import string

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_algos.train.config import GRPOConfig
from hybrid_cli.flags import convert, field_specs, known_names
from hybrid_cli.main import load_config
from hybrid_core.errors import ConfigError

SPECS = field_specs(GRPOConfig)
# Fields whose value names something on disk or a module to import: their checks are tested in test_invalid_inputs.
SIDE_EFFECTS = {
    "reward_fn",
    "pretrain",
    "reward_pretrain",
    "critic_pretrain",
    "prompt_data",
    "save_path",
    "ckpt_path",
    "ray_temp_dir",
    "use_wandb",
    "address",
    "plugins",
}
FIELDS = sorted(n for n in SPECS if n not in SIDE_EFFECTS)
NAMES = set(known_names(GRPOConfig)) | {"arguments", "config", "placement"}
words = st.text(string.ascii_letters + string.digits + "-_.=,:{}[] ", min_size=0, max_size=12)
QUICK = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _field_named(e: ConfigError) -> bool:
    return e.field.split(".")[0] in NAMES and str(e).startswith(e.field)


@QUICK
@given(name=st.sampled_from(FIELDS), text=words)
def test_any_text_for_any_flag_parses_or_names_a_setting(name, text):
    spec = SPECS[name]
    argv = [f"--{name}"] + ([] if spec.kind == "bool" else text.split() or [text])
    try:
        config = load_config("grpo", argv)[0]
    except ConfigError as e:
        assert _field_named(e), str(e)
        return
    if spec.kind in ("int", "float", "str") and len(argv) == 2:
        assert getattr(config, name) == convert(spec, argv[1])


@QUICK
@given(name=st.sampled_from([n for n in FIELDS if SPECS[n].kind == "int"]), value=st.integers(-(10**6), 10**6))
def test_integers_round_trip_or_are_refused_by_name(name, value):
    try:
        config = load_config("grpo", [f"--{name}", str(value)])[0]
    except ConfigError as e:
        assert _field_named(e), str(e)
        return
    assert getattr(config, name) == value


batches = st.fixed_dictionaries(
    {
        "rollout_batch_size": st.integers(1, 64),
        "n_samples_per_prompt": st.integers(2, 8),
        "train_batch_size": st.integers(1, 128),
        "micro_train_batch_size": st.integers(1, 32),
        "actor_learning_rate": st.floats(1e-8, 1e-1),
        "eps_clip": st.floats(0.01, 0.99),
        "bf16": st.booleans(),
        "zero_stage": st.integers(1, 3),
        "temperature": st.floats(0, 2),
    }
)


@QUICK
@given(values=batches)
def test_batch_arithmetic_is_accepted_exactly_when_it_divides(values):
    samples = values["rollout_batch_size"] * values["n_samples_per_prompt"]
    divides = (
        samples % values["train_batch_size"] == 0 and values["train_batch_size"] % values["micro_train_batch_size"] == 0
    )
    argv = [
        w for k, v in values.items() for w in ([f"--{k}"] if v is True else [] if v is False else [f"--{k}", repr(v)])
    ]
    try:
        config = load_config("grpo", argv)[0]
    except ConfigError as e:
        assert not divides and e.field in ("train_batch_size", "micro_train_batch_size"), str(e)
        assert "Fix:" in str(e)
        return
    assert divides
    for key, value in values.items():
        assert getattr(config, key) == value


@st.composite
def valid_batches(draw):
    """Settings whose batch arithmetic works: micro x k1 = train batch, train batch x k2 = rollout prompts."""
    values = draw(batches)
    micro, k1, k2 = draw(st.integers(1, 8)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    values.update(micro_train_batch_size=micro, train_batch_size=micro * k1, rollout_batch_size=micro * k1 * k2)
    return values


@QUICK
@given(values=valid_batches())
def test_yaml_file_and_flags_give_the_same_config(values, tmp_path_factory):
    path = tmp_path_factory.mktemp("yaml") / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    from_file = load_config("grpo", ["--config", str(path)])[0]
    argv = [
        w for k, v in values.items() for w in ([f"--{k}"] if v is True else [] if v is False else [f"--{k}", repr(v)])
    ]
    assert from_file == load_config("grpo", argv)[0]


@pytest.mark.parametrize("name", [n for n in FIELDS if SPECS[n].kind in ("int", "float")])
def test_every_number_field_refuses_text_by_name(name):
    with pytest.raises(ConfigError) as e:
        load_config("grpo", [f"--{name}", "many"])
    assert e.value.field == name and "Fix:" in str(e.value)
