"""A role that dies is named at once, with the line that explains it; joining a cluster that is not there fails
within a deadline; a local Ray's processes keep out of the driver's process group.

Real Ray (one local instance, started by :func:`hybrid_core.cluster.connect` as a run starts it) and real actors:
one exits in its constructor after writing its cause to stderr (what a library crashing in a child process
leaves), another hangs in its constructor (an engine waiting for a peer that died).
"""

import os
import shutil
import socket
import sys
import tempfile
import threading
import time

import pytest

from hybrid_core.cluster import check_gcs
from hybrid_core.death_cause import death_cause
from hybrid_core.errors import ConfigError, RoleFailure
from timing_bounds import HANG_S, RUN_HANG_S

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from hybrid_core.cluster import connect

    temp = tempfile.mkdtemp(prefix="hyray", dir="/tmp")  # Ray's socket paths must stay short
    info = connect(num_gpus=1, num_cpus=2, temp_dir=temp)
    yield info
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def test_a_death_ends_the_wait_at_once_naming_the_cause_while_another_call_hangs(local_ray):
    import ray

    from hybrid_core.remote import get_all_with_timeout

    class _Dies:  # (defined here: Ray ships it by value; a test module is not importable in a worker)
        def __init__(self):
            print("OSError: [Errno 98] Address already in use", file=sys.stderr, flush=True)
            # Ray 2.60 writes a worker's stderr to its log from a thread of the worker: os._exit right after the
            # print races that write (a process dying of an exception gets its last line out before it exits)
            time.sleep(1.0)
            os._exit(1)

        def ready(self):
            return True

    class _Hangs:
        def __init__(self):
            time.sleep(3600)

        def ready(self):
            return True

    hangs = ray.remote(num_cpus=0)(_Hangs).remote()
    dies = ray.remote(num_cpus=0)(_Dies).remote()
    start = time.monotonic()
    with pytest.raises(RoleFailure) as info:
        # the hanging engine first: before, the wait took every call's answer (or the 600 s) before raising
        get_all_with_timeout(
            [
                ("rollout engine 0: start on GPU 0", hangs.ready.remote()),
                ("rollout engine 1: start on GPU 1", dies.ready.remote()),
            ],
            600,
        )
    took = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("rollout engine 1: start on GPU 1: the actor died"), message
    assert "OSError: [Errno 98] Address already in use" in message, message  # its last stderr line, not Ray's text
    assert took < HANG_S, f"{took:.0f} s"  # far below the 600 s deadline: the death ended the wait
    ray.kill(hangs)


def test_an_exception_in_a_constructor_is_named_by_its_own_last_line(local_ray):
    import ray

    @ray.remote(num_cpus=0)
    class Raises:
        def __init__(self):
            raise RuntimeError("Engine core initialization failed. See root cause above.")

        def ready(self):
            return True

    with pytest.raises(ray.exceptions.RayActorError) as info:
        ray.get(Raises.remote().ready.remote(), timeout=60)
    assert death_cause(info.value) == "RuntimeError: Engine core initialization failed. See root cause above."


def test_the_local_ray_is_a_gcs_and_keeps_out_of_the_drivers_process_group(local_ray):
    check_gcs(local_ray.address, timeout_s=10)  # a real GCS (token authentication on) is not refused
    gcs = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).split(b"\0")[0].endswith(b"gcs_server")]
    ours = [p for p in gcs if _parent_chain_has(int(p), os.getpid())]
    assert ours, "the GCS of this test's Ray was not found"
    for pid in ours:  # `kill -- -PGID` of the driver's group (what SLURM / systemd / a shell send) misses Ray
        assert os.getpgid(int(pid)) != os.getpgrp()


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _parent_chain_has(pid: int, ancestor: int) -> bool:
    for _ in range(10):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
    return False


# ---- joining a cluster that is not there (no Ray started) --------------------------------------------------------
def test_an_address_where_nothing_listens_is_refused_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        check_gcs(f"127.0.0.1:{port}", source="RAY_ADDRESS")
    assert time.monotonic() - start < HANG_S
    assert info.value.field == "RAY_ADDRESS" and "nothing answers" in info.value.problem
    assert "Unset RAY_ADDRESS" in info.value.fix


def test_a_port_of_another_service_is_refused_within_the_deadline():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    accepted = []
    threading.Thread(target=lambda: accepted.extend(server.accept() for _ in range(4)), daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(ConfigError) as info:
            check_gcs(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=3)
    finally:
        server.close()
    assert time.monotonic() - start < HANG_S  # timeout_s=3 ended it; the bound only catches a hang
    assert info.value.field == "run.address" and "not as a Ray cluster's GCS" in info.value.problem


@pytest.mark.slow
def test_the_cli_refuses_a_closed_address_with_a_hybrid_line(tmp_path, capsys):
    import ray

    from hybrid_cli.main import main

    if ray.is_initialized():  # a Ray another test of this worker left connected would be used as it is
        ray.shutdown()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    code = main(
        [
            "grpo",
            "--address",
            f"127.0.0.1:{port}",
            "--max_steps",
            "1",
            "--task_length",
            "1",
            "--rollout_batch_size",
            "4",
            "--n_samples_per_prompt",
            "2",
            "--train_batch_size",
            "8",
            "--micro_train_batch_size",
            "8",
            "--save_path",
            str(tmp_path / "run"),
            "--no_use_tensorboard",
        ]
    )
    assert code == 2 and time.monotonic() - start < RUN_HANG_S
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"hybrid: error: address: nothing answers at 127.0.0.1:{port}"), last
