import os
import signal
import subprocess
import sys
import textwrap

from hybrid_algos.train.checkpoint import CheckpointManager


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
