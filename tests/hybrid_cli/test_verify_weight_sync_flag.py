"""--verify_weight_sync full|sampled|off (issue 34 section 4): the default samples, --no_verify_weight_sync (and a
config file's old ``verify_weight_sync: false``) still means off, anything else is refused naming the setting."""

from __future__ import annotations

import pytest

from hybrid_cli.main import load_config
from hybrid_core.errors import ConfigError


@pytest.mark.parametrize(
    "argv, mode",
    [
        ([], "sampled"),
        (["--verify_weight_sync", "full"], "full"),
        (["--verify_weight_sync", "off"], "off"),
        (["--no_verify_weight_sync"], "off"),
    ],
)
def test_the_modes_and_the_old_switch(argv, mode):
    assert load_config("grpo", argv)[0].verify_weight_sync == mode


@pytest.mark.parametrize("written, mode", [("false", "off"), ("true", "sampled"), ("full", "full")])
def test_a_config_file_from_when_it_was_a_switch(tmp_path, written, mode):
    path = tmp_path / "run.yaml"
    path.write_text(f"verify_weight_sync: {written}\n")
    assert load_config("grpo", ["--config", str(path)])[0].verify_weight_sync == mode


def test_an_unknown_mode_is_refused_naming_the_setting():
    with pytest.raises(ConfigError, match=r"verify_weight_sync.*sampled, full, off"):
        load_config("grpo", ["--verify_weight_sync", "sometimes"])
