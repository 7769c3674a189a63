"""Errors raised in a Ray worker reach the driver pickled: each must come back whole (type, field, message, fix),
not as Ray's "failed to deserialize" stand-in."""

from __future__ import annotations

import pickle

import pytest

from hybrid_algos.errors import AlgoInputError
from hybrid_core.errors import ConfigError, PlacementError


@pytest.mark.parametrize("cls", [ConfigError, PlacementError, AlgoInputError])
def test_error_round_trips_through_pickle(cls):
    err = cls("policy_loss_type", "unknown policy loss 'mine'.", "Pass --plugins my_losses.py.")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert (back.field, back.problem, back.fix) == (err.field, err.problem, err.fix)
    assert str(back) == str(err)


def test_plugin_error_round_trips_through_pickle():
    from hybrid_algos.train.plugins import PluginError

    back = pickle.loads(pickle.dumps(PluginError("plugins", "no file x.py", "Give the path.")))
    assert type(back) is PluginError and back.fix == "Give the path."
