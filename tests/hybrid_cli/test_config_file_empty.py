"""An empty --config file (or one holding only comments) sets nothing: the run is the one without --config.

Found by the type checker (mypy.ini): ``load_config_file`` returned ``{}`` for an empty file where its callers unpack
two mappings, so ``hybrid ppo --config empty.yaml`` died with an internal ValueError.
"""

import pytest

from hybrid_cli.config_file import load_config_file
from hybrid_cli.main import load_config


@pytest.mark.parametrize("text", ["", "# settings to come\n"])
def test_an_empty_config_file_sets_nothing(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    from hybrid_algos.train.config import PPOConfig

    assert load_config_file(str(path), PPOConfig) == ({}, {})
    with_file, _, _ = load_config("ppo", ["--config", str(path)])
    without, _, _ = load_config("ppo", [])
    assert with_file == without
