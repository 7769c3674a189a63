"""The run folder before a run starts: an earlier run is refused or removed whole, never mixed; leftovers of a start
that recorded nothing do not block; folders that cannot hold files are found at once."""

import os

import pytest

from hybrid_algos.train import marks
from hybrid_algos.train.checkpoint import CheckpointManager
from hybrid_algos.train.run_folder import check_writable, refuse_or_clear
from hybrid_core.errors import ConfigError


def _earlier_run(run, ckpt_root=None):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "logs").mkdir()
    (run / "notes.txt").write_text("the user's own file")
    marks.claim(str(run), ["metrics.jsonl", "logs"])  # what a run claims before it writes them
    mgr = CheckpointManager(str(ckpt_root or run / "checkpoints"))
    mgr.save(3, lambda folder: None, {"next_step": 3})
    return mgr


def test_an_earlier_run_is_refused_naming_the_ways_on(tmp_path):
    run = tmp_path / "run"
    mgr = _earlier_run(run)
    with pytest.raises(ConfigError) as info:
        refuse_or_clear(str(run), mgr, overwrite=False, resuming=False)
    message = str(info.value)
    assert info.value.field == "save_path" and "metrics.jsonl" in message and "checkpoints" in message
    assert "--resume" in message and "--overwrite" in message and "run-2)" in message  # a fresh name that is free
    assert (run / "metrics.jsonl").exists() and mgr.latest()[1] == 3  # untouched
    refuse_or_clear(str(run), mgr, overwrite=False, resuming=True)  # continuing it is fine


def test_overwrite_removes_the_earlier_run_and_only_it(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "elsewhere" / "ckpt"
    mgr = _earlier_run(run, ckpt)
    (ckpt / "README").write_text("kept")
    refuse_or_clear(str(run), mgr, overwrite=True, resuming=False)
    assert sorted(os.listdir(run)) == [marks.MARKS, "notes.txt"]  # the run's files are gone, the user's stay
    assert mgr.latest() is None and sorted(os.listdir(ckpt)) == ["README"]


def test_checkpoints_elsewhere_count_as_the_run(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run.mkdir()
    mgr = CheckpointManager(str(ckpt))
    mgr.save(1, lambda folder: None, {"next_step": 1})
    with pytest.raises(ConfigError, match=str(ckpt)):
        refuse_or_clear(str(run), mgr, overwrite=False, resuming=False)


def test_leftovers_of_a_start_that_recorded_nothing_do_not_block(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "stacks-actor-0.txt").write_text("evidence")
    (run / "metrics.jsonl").write_text("")
    (run / "tiny-model").mkdir()
    marks.claim(str(run), ["logs", "metrics.jsonl"])
    refuse_or_clear(str(run), CheckpointManager(str(run / "checkpoints")), overwrite=False, resuming=False)
    assert sorted(os.listdir(run)) == [marks.MARKS, "logs", "tiny-model"]


def test_folders_that_cannot_hold_files(tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder") as info:
        check_writable("save_path", str(file))
    assert info.value.field == "save_path"
    with pytest.raises(ConfigError, match="cannot be created") as info:
        check_writable("ckpt_path", str(file / "ckpt"))
    assert info.value.field == "ckpt_path" and "Not a directory" in str(info.value)
    if os.geteuid() != 0:  # root writes into read-only folders anyway
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        with pytest.raises(ConfigError, match="is not writable"):
            check_writable("save_path", str(ro))
    assert check_writable("save_path", str(tmp_path / "new" / "run")) == str(tmp_path / "new" / "run")
    assert os.listdir(tmp_path / "new" / "run") == []  # the write probe leaves nothing
