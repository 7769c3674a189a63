import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from hybrid_algos.train import checkpoint as ckpt_module
from hybrid_algos.train.checkpoint import CheckpointError, CheckpointManager, UnsafeCheckpoint, verify_role_files


def _save(mgr, step, payload=b"x"):
    def roles(folder):
        with open(os.path.join(folder, "weights.bin"), "wb") as f:
            f.write(payload)

    return mgr.save(step, roles, {"next_step": step})


def test_latest_and_pruning(tmp_path):
    mgr = CheckpointManager(str(tmp_path), max_keep=2)
    assert mgr.latest() is None
    for step in (1, 2, 3):
        _save(mgr, step, payload=bytes([step]))
    path, step = mgr.latest()
    assert step == 3 and open(os.path.join(path, "weights.bin"), "rb").read() == b"\x03"
    assert [s for _, s in mgr.complete_checkpoints()] == [2, 3]
    assert mgr.load_driver_state(path)["next_step"] == 3


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    _save(mgr, 1, payload=b"good")
    # A second save that is SIGKILLed while writing its role states.
    script = textwrap.dedent(f"""
        import os, time
        from hybrid_algos.train.checkpoint import CheckpointManager
        def roles(folder):
            with open(os.path.join(folder, "weights.bin"), "wb") as f:
                f.write(b"partial")
                f.flush()
                print("writing", flush=True)
                time.sleep(60)
        CheckpointManager({str(tmp_path)!r}).save(2, roles, {{"next_step": 2}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    path, step = mgr.latest()
    assert step == 1
    assert open(os.path.join(path, "weights.bin"), "rb").read() == b"good"
    assert mgr.sweep_incomplete()  # the half-written temp folder is found and removed
    assert [s for _, s in mgr.complete_checkpoints()] == [1]


# ---- plain data, damaged files, full disks, pickles that would run code ----------------------------------------------


class _RunsCode:
    """Unpickling this runs ``touch <marker>``: what a crafted checkpoint does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_driver_state_is_plain_json_with_a_checksum(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    path = mgr.save(1, lambda folder: None, {"next_step": 1, "history": [{"reward": float("nan")}], "pair": (1, 2)})
    raw = open(os.path.join(path, "driver_state.json"), "rb").read()
    assert json.loads(raw)["pair"] == [1, 2]
    assert not os.path.exists(os.path.join(path, "driver_state.pt"))
    assert "sha256" in json.loads(open(os.path.join(path, "COMPLETE.json")).read())
    with pytest.raises(TypeError, match="not plain data"):  # nothing but plain data goes in
        mgr.save(2, lambda folder: None, {"next_step": 2, "obj": object()})
    assert [s for _, s in mgr.complete_checkpoints()] == [1]


def test_an_old_pickled_driver_state_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    path = _save(mgr, 1)
    os.remove(os.path.join(path, "driver_state.json"))
    torch.save({"next_step": 1, "payload": _RunsCode(marker)}, os.path.join(path, "driver_state.pt"))
    with pytest.raises(UnsafeCheckpoint, match="would run code"):
        mgr.resume_point()
    assert not marker.exists()
    # ... while an old one holding plain data still reads (weights_only=True)
    torch.save(
        {"next_step": 1, "history": [{"reward": 0.5}], "config": {"eps": (0.2, 0.3)}},
        os.path.join(path, "driver_state.pt"),
    )
    assert mgr.resume_point()[2]["history"] == [{"reward": 0.5}]


def test_a_role_file_that_would_run_code_is_refused_before_deepspeed_loads_it(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    marker = tmp_path / "pwned"
    mgr = CheckpointManager(str(tmp_path / "ckpt"))

    def roles(folder):  # what DeepSpeed writes: tensors, plain containers, its enum and loss scaler
        os.makedirs(os.path.join(folder, "actor", "state"))
        torch.save(
            {"module": {"w": torch.ones(3)}, "zero_stage": ZeroStageEnum.gradients, "scaler": LossScaler(1.0)},
            os.path.join(folder, "actor", "state", "mp_rank_00_model_states.pt"),
        )

    path = mgr.save(1, roles, {"next_step": 1})
    assert verify_role_files(path) == 1
    assert mgr.resume_point()[1] == 1
    torch.save(
        {"module": {"w": torch.ones(3)}, "extra": _RunsCode(marker)},
        os.path.join(path, "actor", "state", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    )
    with pytest.raises(UnsafeCheckpoint, match=r"posix.system|os.system|system"):
        mgr.resume_point()
    assert not marker.exists()
    assert verify_role_files(path, trusted=True) == 0  # --trust_checkpoint: the user's own decision


def test_damaged_latest_pointer_falls_back_to_the_newest_complete_checkpoint(tmp_path, caplog):
    mgr = CheckpointManager(str(tmp_path))
    for step in (1, 2):
        _save(mgr, step)
    (tmp_path / "latest.json").write_text('{"step": 2, "pa')
    with caplog.at_level(logging.WARNING):
        _path, step, state = mgr.resume_point()
    assert step == 2 and state["next_step"] == 2 and "latest.json is damaged" in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing"])
def test_damaged_driver_state_falls_back_to_the_previous_checkpoint(tmp_path, caplog, damage):
    mgr = CheckpointManager(str(tmp_path))
    for step in (1, 2):
        _save(mgr, step)
    state_file = tmp_path / "step-00000002" / "driver_state.json"
    raw = state_file.read_bytes()
    if damage == "truncated":
        state_file.write_bytes(raw[: len(raw) // 2])
    elif damage == "flipped":  # still valid JSON: only the checksum tells
        state_file.write_bytes(raw.replace(b'"next_step": 2', b'"next_step": 7'))
    else:
        state_file.unlink()
    with caplog.at_level(logging.WARNING):
        _path, step, state = mgr.resume_point()
    assert step == 1 and state["next_step"] == 1
    assert "step-00000002 is unusable" in caplog.text
    (tmp_path / "step-00000001" / "driver_state.json").write_text("{")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        mgr.resume_point()


def test_pruning_happens_before_the_save_so_the_disk_never_holds_more_than_max_keep(tmp_path):
    mgr = CheckpointManager(str(tmp_path), max_keep=2)
    seen = []

    def roles(folder):
        seen.append(len(mgr.complete_checkpoints()))

    for step in (1, 2, 3, 4):
        mgr.save(step, roles, {"next_step": step})
    assert seen == [0, 1, 1, 1]  # while a save is written, at most max_keep - 1 others exist
    assert [s for _, s in mgr.complete_checkpoints()] == [3, 4]
    one = CheckpointManager(str(tmp_path / "one"), max_keep=1)  # the only checkpoint stays until its successor is
    one.save(1, lambda f: None, {"next_step": 1})  # complete
    one.save(2, lambda f: seen.append(len(one.complete_checkpoints())), {"next_step": 2})
    assert seen[-1] == 1 and [s for _, s in one.complete_checkpoints()] == [2]


def test_a_full_disk_says_no_space_left_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    mgr = CheckpointManager(str(tmp_path))
    _save(mgr, 1, payload=b"good")

    def python_write(folder):  # a write from Python: the OS says ENOSPC
        with open("/dev/full", "wb") as f:
            f.write(b"x" * 4096)
            f.flush()

    def torch_write(folder):  # torch.save on a full disk: "enforce fail at inline_container.cc ... unexpected pos"
        torch.save(torch.zeros(100_000), "/dev/full")

    with pytest.raises(CheckpointError, match="no space left on device") as info:
        mgr.save(2, python_write, {"next_step": 2})
    assert "--max_ckpt_num" in str(info.value) and "--resume" in str(info.value)
    monkeypatch.setattr(ckpt_module, "_free_bytes", lambda path: 0)  # the disk the checkpoints are on is full
    with pytest.raises(CheckpointError, match="no space left on device") as info:
        mgr.save(2, torch_write, {"next_step": 2})
    assert "inline_container" not in str(info.value)
    assert not any(name.startswith(".tmp") for name in os.listdir(tmp_path))  # nothing half-written is left
    path, step = mgr.latest()
    assert step == 1 and open(os.path.join(path, "weights.bin"), "rb").read() == b"good"


@pytest.mark.parametrize("where", ["driver_state.json", "weights.bin", "latest.json"])
def test_a_fifo_in_a_checkpoint_is_refused_not_waited_on(tmp_path, caplog, where):
    """A FIFO where a file should be: opening it for reading waits for a writer forever (--resume hung silently).
    It is named and skipped like any damaged file, within the test's own deadline (a child process, so a hang fails)."""
    mgr = CheckpointManager(str(tmp_path))
    for step in (1, 2):
        _save(mgr, step)
    target = tmp_path / where if where == "latest.json" else tmp_path / "step-00000002" / where
    target.unlink()
    os.mkfifo(target)
    script = textwrap.dedent(f"""
        import logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        from hybrid_algos.train.checkpoint import CheckpointManager
        path, step, state = CheckpointManager({str(tmp_path)!r}).resume_point()
        print("RESUMED", step)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = 2 if where == "latest.json" else 1  # a bad pointer falls back to the newest complete checkpoint
    assert f"RESUMED {expected}" in done.stdout
    assert "is a FIFO, not a file" in done.stdout
