"""Where a run's groups meet (hybrid_core.rendezvous): loopback on one node, rank 0's cluster address across nodes;
a store made by the module listens on that address only (not reachable on this machine's network address) and stops
listening once the group has formed. Real TCPStores and real gloo groups (two ranks on threads of this process)."""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

import pytest
import torch

from hybrid_core import rendezvous
from hybrid_core.errors import ConfigError
from hybrid_core.placement import PlacementSpec
from hybrid_core.weight_sync import create_sync_group

TIMEOUT = timedelta(seconds=10)


def _network_address() -> str | None:
    """An IPv4 address of this machine other than loopback (where someone on the network would connect)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127."):
                return address
    return None


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) listening on ``port``, any process."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if fields[3] == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


def _connects(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False


# ---- the decision ------------------------------------------------------------------------------------------------
def test_one_node_meets_on_loopback_several_nodes_on_rank_0s_cluster_address():
    one = rendezvous.choose(["10.1.0.5", "10.1.0.5", "10.1.0.5"])
    assert (one.host, one.single_node) == ("127.0.0.1", True)
    assert one.describe() == "rendezvous: 127.0.0.1 (single node; loopback only)"
    assert rendezvous.choose(["127.0.0.1"]).host == "127.0.0.1"  # a local Ray's node IP
    many = rendezvous.choose(["10.1.0.5", "10.1.0.6"])
    assert (many.host, many.single_node) == ("10.1.0.5", False)
    assert rendezvous.choose(["10.1.0.6", "10.1.0.5"], rank0_ip="10.1.0.5").host == "10.1.0.5"
    with pytest.raises(ConfigError, match="loopback"):  # the other nodes could not reach it
        rendezvous.choose(["127.0.0.1", "10.1.0.6"])


def test_each_rank_binds_loopback_on_one_node_and_its_own_node_address_across_nodes():
    assert rendezvous.bind_address("127.0.0.1", node_ip="10.1.0.6") == "127.0.0.1"
    assert rendezvous.bind_address("10.1.0.5", node_ip="10.1.0.6") == "10.1.0.6"
    with pytest.raises(ConfigError, match="node address"):
        rendezvous.bind_address("10.1.0.5", node_ip="0.0.0.0")


def test_the_plan_decides_for_the_dry_run():
    single = PlacementSpec.from_ranges({"actor": "0-1", "rollout": "0-1"}).plan()
    assert rendezvous.for_plan(single).describe() == "rendezvous: 127.0.0.1 (single node; loopback only)"
    spread = PlacementSpec.from_ranges({"actor": "0-1", "rollout": "2-3"}, gpus_per_node=2).plan()
    assert not rendezvous.for_plan(spread).single_node


def test_gloo_and_nccl_sockets_follow_the_bind_address_unless_the_user_chose():
    env: dict[str, str] = {}
    assert rendezvous.use_interface("127.0.0.1", env) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    mine = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert rendezvous.use_interface("127.0.0.1", mine)["NCCL_SOCKET_IFNAME"] == "ib0"


# ---- the store ---------------------------------------------------------------------------------------------------
def test_a_store_listens_on_loopback_only_and_stops_once_the_group_formed():
    port = rendezvous.free_port()
    store = rendezvous.open_store("127.0.0.1", port, 2, is_master=True, timeout=TIMEOUT, what="test group")
    assert _listening(port) == ["0100007F"]  # 127.0.0.1, never 00000000 (0.0.0.0) or :: (IPv4 and IPv6)
    client = rendezvous.open_store("127.0.0.1", port, 2, is_master=False, timeout=TIMEOUT)
    client.set("k", b"v")
    assert store.get("k") == b"v"

    peer = threading.Thread(target=client.close_when_formed, args=(1, 2))
    peer.start()
    store.close_when_formed(0, 2)
    peer.join(timeout=10)
    assert store.closed and client.closed
    assert _listening(port) == [] and not _connects("127.0.0.1", port)
    with pytest.raises(RuntimeError, match="closed once the groups formed"):
        store.get("k")


def test_a_store_that_will_close_turns_off_nccls_poll_of_it(monkeypatch):
    """NCCL's heartbeat monitor would poll the closed store every second and log a warning each time."""
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    monkeypatch.delenv(rendezvous.KEEP_OPEN_ENV, raising=False)
    store = rendezvous.open_store("127.0.0.1", rendezvous.free_port(), 1, is_master=True, timeout=TIMEOUT)
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    store.close_when_formed(0, 1)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # the user's own setting stands
    store = rendezvous.open_store("127.0.0.1", rendezvous.free_port(), 1, is_master=True, timeout=TIMEOUT)
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    store.close_when_formed(0, 1)
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT")
    monkeypatch.setenv(rendezvous.KEEP_OPEN_ENV, "1")  # a store kept open can carry the flag: NCCL's default
    store = rendezvous.open_store("127.0.0.1", rendezvous.free_port(), 1, is_master=True, timeout=TIMEOUT)
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ
    store.close_when_formed(0, 1)


def test_keep_open_leaves_the_store_listening_on_its_address(monkeypatch):
    """HYBRID_RENDEZVOUS_KEEP_OPEN=1: the way back should a library need the store after set-up (still loopback)."""
    monkeypatch.setenv(rendezvous.KEEP_OPEN_ENV, "1")
    port = rendezvous.free_port()
    store = rendezvous.open_store("127.0.0.1", port, 2, is_master=True, timeout=TIMEOUT, what="test group")
    client = rendezvous.open_store("127.0.0.1", port, 2, is_master=False, timeout=TIMEOUT)
    peer = threading.Thread(target=client.close_when_formed, args=(1, 2))
    peer.start()
    store.close_when_formed(0, 2)
    peer.join(timeout=10)
    assert not store.closed and _listening(port) == ["0100007F"]
    store.set("k", b"v")
    assert client.get("k") == b"v"


def test_a_store_is_not_reachable_from_the_network():
    outside = _network_address()
    if outside is None:
        pytest.skip("this machine has no network address other than loopback")
    port = rendezvous.free_port()
    store = rendezvous.open_store("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT)
    try:
        assert _connects("127.0.0.1", port)
        assert not _connects(outside, port)
    finally:
        store.close()


def test_weight_sync_group_listens_on_loopback_and_closes_its_store():
    port, out = rendezvous.free_port(), {}
    before = set(_my_listeners())
    t = threading.Thread(target=lambda: out.update(g0=create_sync_group("127.0.0.1", port, 0, 2, timeout_s=10)))
    t.start()
    g1 = create_sync_group("127.0.0.1", port, 1, 2, timeout_s=10)
    t.join(timeout=20)
    g0 = out["g0"]
    try:
        assert g0.store.closed and g1.store.closed
        assert _listening(port) == []  # the store is gone ...
        new = set(_my_listeners()) - before
        assert new and all(address == "0100007F" for address, _ in new), new  # ... gloo's pairs on loopback
        data = torch.arange(4, dtype=torch.float32)
        received = torch.zeros(4)
        work = g1.broadcast(received, what="after close")  # the group still works without its store
        g0.broadcast(data, what="after close").wait()
        work.wait()
        assert torch.equal(received, data)
    finally:
        g0.close(), g1.close()


def _my_listeners() -> list[tuple[str, int]]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    address, hex_port = fields[1].rsplit(":", 1)
                    found.append((address, int(hex_port, 16)))
    return found


def test_a_group_outlives_its_caller_dropping_the_store():
    """The process groups call back into the Python store: one whose caller dropped the returned store must still
    work (its Python half collected, a later ``new_group`` failed "fn INTERNAL ASSERT FAILED ... Not implemented":
    DeepSpeed's first broadcast did, in bench/trainer_gpu.py). In a process of its own: it makes the default group."""
    import subprocess
    import sys

    code = """
import gc
from datetime import timedelta
import torch, torch.distributed as dist
from hybrid_core import rendezvous
port = rendezvous.free_port()
dist.init_process_group("gloo", store=rendezvous.open_store("127.0.0.1", port, 1, is_master=True,
    timeout=timedelta(seconds=10)), rank=0, world_size=1)
gc.collect()
group = dist.new_group([0])  # goes through the store
t = torch.ones(1)
dist.all_reduce(t, group=group)
print("ok", float(t))
dist.destroy_process_group()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok 1.0" in done.stdout, done.stderr[-2000:]
