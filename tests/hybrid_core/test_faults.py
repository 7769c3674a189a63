"""HYBRID_FAULT, the test-only fault injection: its grammar, and that it acts on the nth call of the named phase."""

import pytest

from hybrid_core import faults
from hybrid_core.errors import ConfigError
from hybrid_core.faults import Fault, maybe_inject, parse_faults


def test_grammar():
    assert parse_faults(None) == [] and parse_faults("") == []
    assert parse_faults("actor:train:hang,critic/1:values:die:3") == [
        Fault("actor", None, "train", "hang", 1),
        Fault("critic", 1, "values", "die", 3),
    ]


@pytest.mark.parametrize("text", ["actor:train", "actor:train:explode", "actor/x:train:die", "actor:train:die:0"])
def test_bad_values_are_config_errors(text):
    with pytest.raises(ConfigError) as e:
        parse_faults(text)
    assert e.value.field == "HYBRID_FAULT" and e.value.fix


def test_acts_on_the_nth_call_of_the_phase_and_rank_only(monkeypatch):
    monkeypatch.setattr(faults, "_calls", type(faults._calls)())
    monkeypatch.setenv("HYBRID_FAULT", "actor/1:train:raise:2")
    maybe_inject("actor", "train", 0)  # another rank: not counted
    maybe_inject("actor", "logprobs", 1)  # another phase
    maybe_inject("actor", "train", 1)  # 1st call
    with pytest.raises(RuntimeError, match="actor rank 1 failed in train"):
        maybe_inject("actor", "train", 1)
    maybe_inject("actor", "train", 1)  # 3rd call: passes again
    monkeypatch.delenv("HYBRID_FAULT")
    maybe_inject("actor", "train", 1)
