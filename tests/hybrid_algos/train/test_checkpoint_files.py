"""Each checkpoint file's size and CRC-32 are saved with it and checked before a resume loads it: a flipped byte, a
truncated or a missing shard is named and the previous intact checkpoint is used, as for a damaged driver state.

Real checkpoint folders written by :class:`CheckpointManager` with torch files where DeepSpeed puts its own (the
end-to-end case with DeepSpeed's files is in tests/hybrid_cli/test_run_safety.py)."""

import json
import logging
import os

import pytest
import torch

from hybrid_algos.train.checkpoint import COMPLETE, CheckpointError, CheckpointManager, verify_role_files
from hybrid_algos.train.checkpoint_files import problems, record

SHARD = os.path.join("actor", "state", "mp_rank_00_model_states.pt")


def _save(mgr, step):
    def roles(folder):
        os.makedirs(os.path.join(folder, "actor", "state"))
        torch.save({"module": {"w": torch.full((4096,), float(step))}}, os.path.join(folder, SHARD))
        torch.save(
            {"optimizer": {"m": torch.zeros(1024)}},
            os.path.join(folder, "actor", "state", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        )

    return mgr.save(step, roles, {"next_step": step})


def _flip(path, at=None, n=64):
    with open(path, "r+b") as f:
        f.seek(at if at is not None else os.path.getsize(path) // 2)
        data = f.read(n)
        f.seek(-len(data), 1)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.fixture
def two(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    return mgr, _save(mgr, 10), _save(mgr, 20)


def test_the_manifest_lists_every_role_file(two):
    _mgr, _, newest = two
    with open(os.path.join(newest, COMPLETE)) as f:
        files = json.load(f)["files"]
    assert sorted(files) == [SHARD, os.path.join("actor", "state", "zero_pp_rank_0_mp_rank_00_optim_states.pt")]
    assert files[SHARD]["size"] == os.path.getsize(os.path.join(newest, SHARD))
    assert files == record(newest, skip=("driver_state.json", COMPLETE)) and problems(newest, files) == []


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda p: _flip(p), "differs from what was saved"),
        (lambda p: os.truncate(p, os.path.getsize(p) - 100), "has"),
        (os.remove, "is missing"),
    ],
)
def test_a_damaged_shard_is_named_and_the_previous_checkpoint_used(two, caplog, damage, said):
    mgr, previous, newest = two
    shard = os.path.join(newest, SHARD)
    if said == "differs from what was saved":
        verify_role_files(newest)  # the flipped bytes are tensor data: unpickling alone does not notice
    damage(shard)
    caplog.set_level(logging.WARNING)
    path, step, _ = mgr.resume_point()
    assert (path, step) == (previous, 10)
    assert f"{shard} {said}" in caplog.text and "trying the previous one" in caplog.text


def test_every_checkpoint_damaged_names_the_files(two):
    mgr, previous, newest = two
    os.remove(os.path.join(newest, SHARD))
    _flip(os.path.join(previous, SHARD))
    with pytest.raises(CheckpointError) as info:
        mgr.resume_point()
    assert f"{newest}/{SHARD} is missing" in str(info.value) and f"{previous}/{SHARD} differs" in str(info.value)


def test_a_checkpoint_saved_without_a_manifest_still_resumes(two):
    mgr, _, newest = two
    complete = os.path.join(newest, COMPLETE)
    with open(complete) as f:
        data = json.load(f)
    del data["files"]  # as older versions wrote it
    with open(complete, "w") as f:
        json.dump(data, f)
    assert mgr.verify_files(newest) == 0 and mgr.resume_point()[1] == 20
