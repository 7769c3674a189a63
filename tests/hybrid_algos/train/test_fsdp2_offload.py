"""Sleep for the FSDP2 backend (hybrid_core.offload.fsdp2_offload): on 2 gloo ranks the local shards of parameters,
gradients and optimizer state leave their storages (every byte counted) and come back bit for bit, inside an
update and between updates, everything at once or state by state; the run then trains exactly as one that never
slept."""

from __future__ import annotations

import pytest
from fsdp2_launch import run_ranks


@pytest.fixture(scope="module")
def cycled(tmp_path_factory) -> list[dict]:
    return run_ranks("offload", 2, tmp_path_factory.mktemp("fsdp2_offload"))


def test_everything_leaves_mid_update_and_returns_bit_identical(cycled) -> None:
    for r in cycled:
        assert r["grads_expected"] > 0  # mid-update: the first micro-batch's gradient shards are there to move
        assert r["moved_all"] == r["expected_all"] > 0  # every byte of the three states' storages was copied out
        assert r["left_on_device"] == 0  # ... and their storages freed
        assert r["asleep"] and r["forward_refused"]  # a forward on freed shards is refused, not run on garbage
        assert r["reloaded"] == r["moved_all"] and r["bit_identical"]


def test_one_state_moves_without_the_others(cycled) -> None:
    for r in cycled:
        assert r["moved"] == r["expected"]
        # the optimizer away: the parameter shards stay; parameters and gradients away: the moments stay
        assert r["away_while_optimizer"]["optimizer"] == 0 and r["away_while_optimizer"]["params"] > 0
        assert r["away_while_params+grads"]["params"] == 0 and r["away_while_params+grads"]["optimizer"] > 0
        # gradients and optimizer away: a no-gradient pass runs (as the plan's value and log-prob phases need), a
        # training forward is refused
        assert r["no_grad_pass_with_params_only"] and r["training_forward_refused"]


def test_the_cycled_run_trains_exactly_like_one_that_never_slept(cycled) -> None:
    for r in cycled:
        assert len(r["losses"]) == 4 and r["losses"] == r["plain_losses"]


def test_a_shard_that_cannot_be_freed_refuses_the_offload_before_anything_moves(cycled) -> None:
    for r in cycled:
        # the optimizer (asked first, freeable) stays too: nothing is half offloaded
        assert r["refusal"] == {"refused": True, "kept": True, "away": []}
