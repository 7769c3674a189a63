"""A local run listens on the loopback interface only, for its whole length: a short real run (tiny GRPO, one fake
GPU) is watched from a thread that reads /proc/net/tcp and /proc/net/tcp6 for the LISTEN sockets of the run's
processes (this test process, its children -- Ray's GCS and raylet -- and every Ray worker of the run), and none may
bind 0.0.0.0 or :: . The trainer's rendezvous store (torch binds it to every interface by default) was the hole."""

import os
import threading
import uuid

import pytest
from tiny_runs import tiny_config, worker_pids

from hybrid_algos.train import train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), pytest.mark.usefixtures("one_gpu_ray")]

WILDCARDS = {"00000000", "00000000000000000000000000000000"}  # 0.0.0.0 and ::, as /proc/net/tcp* write them


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def _listeners(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, local address in /proc's hex, port) of every TCP LISTEN socket the processes ``pids`` hold."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in owner:
                    address, port = fields[1].rsplit(":", 1)
                    found.append((owner[fields[9]], address, int(port, 16)))
    return found


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "?"


def test_a_local_run_binds_every_listener_to_loopback(tmp_path, monkeypatch):
    tag = uuid.uuid4().hex
    monkeypatch.setenv("HYBRID_TEST_TAG", tag)  # forwarded to every worker (HYBRID_ prefix)
    seen: dict[tuple[int, str, int], str] = {}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            pids = _descendants(os.getpid())
            pids |= {p for cls in ("PolicyWorker", "ReferenceWorker", "EngineActor") for p in worker_pids(tag, cls)}
            for key in _listeners(pids):
                seen.setdefault(key, _name(key[0]))
            stop.wait(0.3)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        summary = train(tiny_config(tmp_path, max_steps=2))
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert len(summary["history"]) == 2
    names = sorted(set(seen.values()))
    # the watch saw the run: the actor's worker (its gloo sockets, Ray's gRPC) and Ray's own servers
    assert any("PolicyWorker" in name for name in names), f"no listener of the actor's worker was seen: {names}"
    assert any("gcs_server" in name for name in names), f"no listener of Ray's GCS was seen: {names}"
    open_to_all = {
        f"{name} (pid {pid}) on port {port}" for (pid, address, port), name in seen.items() if address in WILDCARDS
    }
    assert not open_to_all, f"listening on every interface: {sorted(open_to_all)}"
