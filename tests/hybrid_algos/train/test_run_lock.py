"""One run per folder: a folder whose lock a live process holds is refused, naming that process; the lock of a
process that is gone (killed, another process under its pid now, a machine silent too long) never blocks."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from hybrid_algos.train import run_lock
from hybrid_algos.train.run_lock import LOCK, RunLock, RunLocks
from hybrid_core.errors import ConfigError

HOLDER = textwrap.dedent("""
    import sys, time
    from hybrid_algos.train.run_lock import RunLock
    RunLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def _holder(folder):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_owner_is_refused_by_name_and_a_killed_one_does_not_block(tmp_path):
    owner = _holder(tmp_path)
    try:
        with pytest.raises(ConfigError) as info:
            RunLock(str(tmp_path)).acquire()
        message = str(info.value)
        assert info.value.field == "save_path"
        assert f"in use by another run: pid {owner.pid} on {socket.gethostname()}, started " in message
        assert time.strftime("%Y-%m-%d") in message and "another --save_path" in message
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert (tmp_path / LOCK).exists()  # a killed run leaves its lock ...
    lock = RunLock(str(tmp_path)).acquire()  # ... which does not block the next one
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK).exists()


def test_a_lock_is_held_until_released_also_within_one_process(tmp_path):
    with RunLocks() as locks:
        locks.take(str(tmp_path), "save_path")
        locks.take(str(tmp_path), "save_path")  # the same folder twice (--ckpt_path = --save_path): one lock
        with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
            RunLock(str(tmp_path)).acquire()
    RunLock(str(tmp_path)).acquire().release()  # released on exit


def _write_lock(folder, **changes):
    owner = {**RunLock(str(folder)).mine(), **changes}
    (folder / LOCK).write_text(json.dumps(owner))


def test_a_reused_pid_and_a_silent_machine_count_as_gone(tmp_path):
    _write_lock(tmp_path, pid=os.getppid(), process_start="1")  # a live pid, but not the process that locked
    RunLock(str(tmp_path)).acquire().release()

    _write_lock(tmp_path, host="other-node", boot_id="x")  # another machine, touched just now: refused
    with pytest.raises(ConfigError, match=r"pid .* on other-node"):
        RunLock(str(tmp_path)).acquire()
    old = time.time() - run_lock.STALE_S - 60
    os.utime(tmp_path / LOCK, (old, old))  # not refreshed for longer than STALE_S: its run is gone
    RunLock(str(tmp_path)).acquire().release()

    (tmp_path / LOCK).write_text("")  # being written by a run starting right now: refused
    with pytest.raises(ConfigError, match="is being written"):
        RunLock(str(tmp_path)).acquire()


def test_release_never_removes_a_lock_that_is_not_its_own(tmp_path):
    lock = RunLock(str(tmp_path)).acquire()
    _write_lock(tmp_path, token="someone-else")
    lock.release()
    assert (tmp_path / LOCK).exists()
