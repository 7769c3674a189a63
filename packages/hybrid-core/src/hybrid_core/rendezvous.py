"""Where a run's torch.distributed groups meet, and which addresses their listeners may bind.

Every group of a run (the DeepSpeed group of the actor and of the critic, the weight-sync group of the actor's rank
0 and the engines) starts from a ``TCPStore`` hosted by its rank 0, then opens gloo / NCCL sockets between its ranks.
torch binds the store to every interface (``*:<port>``, IPv4 and IPv6) and takes gloo's address from the hostname:
a local run was reachable from the network, unauthenticated, for its whole length -- anyone who could reach the
machine could list and set the group's keys. So:

* **One decision** (:func:`choose`): when every member of a group is on one node, the group meets on the loopback
  address (127.0.0.1) and every listener binds there; across nodes it meets on rank 0's cluster address (the node IP
  Ray uses) and each rank binds its own node's cluster address, never the wildcard. The rendezvous host is what the
  ranks are given, so each rank derives its own bind address from it (:func:`bind_address`).
* **A store that listens there only** (:func:`open_store`): rank 0 binds the socket itself and hands it to the
  store (``master_listen_fd``: torch's libuv server then listens on that socket instead of ``::``).
* **gloo / NCCL sockets on that interface** (:func:`use_interface`, :func:`gloo_device`): ``GLOO_SOCKET_IFNAME`` /
  ``NCCL_SOCKET_IFNAME`` name the interface holding the bind address ("lo" on one node), unless the user set them.
* **Closed once the group has formed** (:meth:`RendezvousStore.close_when_formed`): the store is only needed while
  the ranks find each other; after every rank said it is done with it, the store's server stops listening. A later
  use (a group made after set-up) fails naming this module instead of reopening the hole.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .errors import ConfigError, RoleFailure

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class Rendezvous:
    """Where one group meets: ``host`` (rank 0's store, and what every rank is given) and whether it spans nodes."""

    host: str
    single_node: bool

    def describe(self) -> str:
        if self.single_node:
            return f"rendezvous: {self.host} (single node; loopback only)"
        return (
            f"rendezvous: {self.host} (several nodes; each rank's listeners bind its node's cluster address only, "
            f"never 0.0.0.0 / ::)"
        )


def choose(node_ips: Iterable[str], rank0_ip: str | None = None) -> Rendezvous:
    """The rendezvous of a group whose members run on ``node_ips`` (Ray node IPs, one per member, rank 0 first
    unless ``rank0_ip`` names it): loopback when they are all one node, else rank 0's cluster address."""
    ips = [ip for ip in node_ips if ip]
    if not ips:
        raise ConfigError(
            "node_ips",
            "no member of the group has a node address.",
            "Pass the Ray node IP of every member (worker.where()['node_ip']).",
        )
    rank0 = rank0_ip or ips[0]
    if len(set(ips) | {rank0}) == 1:
        return Rendezvous(LOOPBACK, True)
    if is_loopback(rank0):
        raise ConfigError(
            "node_ips",
            f"the group spans nodes {sorted(set(ips))}, but rank 0's address is the "
            f"loopback {rank0}: the other nodes could not reach it.",
            "Start every Ray node on its cluster address (ray start --node-ip-address=...).",
        )
    return Rendezvous(rank0, False)


def for_plan(plan: Any) -> Rendezvous:
    """What a placement plan implies before Ray starts (a dry run): one node -> loopback. On several nodes the
    address is rank 0's node IP, known only once Ray placed the workers."""
    nodes = {plan.node_of(g) for role in plan.roles.values() for w in role.workers for g in w.gpus}
    if len(nodes) <= 1:
        return Rendezvous(LOOPBACK, True)
    return Rendezvous("rank 0's node IP", False)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def bind_address(rendezvous_host: str, node_ip: str | None = None) -> str:
    """The address this process's listeners bind, given the group's rendezvous host: loopback for a loopback
    rendezvous (one node), else this process's own node IP (``node_ip``, default Ray's for this process)."""
    if is_loopback(rendezvous_host):
        return LOOPBACK
    if node_ip is None:
        import ray

        node_ip = ray.util.get_node_ip_address()
    if is_loopback(node_ip) or ipaddress.ip_address(node_ip).is_unspecified:
        raise ConfigError(
            "node_ip",
            f"the group meets at {rendezvous_host}, but this process's node address is {node_ip}.",
            "Start every Ray node on its cluster address (ray start --node-ip-address).",
        )
    return node_ip


def interface_of(address: str) -> str | None:
    """The network interface holding the IPv4 ``address`` ("lo" for 127.0.0.1), or None if none does."""
    wanted = LOOPBACK if is_loopback(address) else address
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue
                if socket.inet_ntoa(packed[20:24]) == wanted:
                    return name
    except (ImportError, OSError):
        pass
    return "lo" if wanted == LOOPBACK else None


def use_interface(address: str, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Point gloo's and NCCL's sockets at the interface of ``address`` (set before the process's first group: NCCL
    reads it once). A value the user set is kept (and logged); returns the variables in effect."""
    env = os.environ if environ is None else environ
    name = interface_of(address)
    if name is None:
        log.warning(
            "rendezvous: no interface holds %s; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME left as they are, "
            "so gloo and NCCL choose their own",
            address,
        )
        return {k: env[k] for k in INTERFACE_ENVS if k in env}
    for key in INTERFACE_ENVS:
        if key not in env:
            env[key] = name
        elif env[key] != name:
            log.warning(
                "rendezvous: %s=%s set by the user is kept (this run's groups bind %s, interface %s)",
                key,
                env[key],
                address,
                name,
            )
    return {k: env[k] for k in INTERFACE_ENVS}


def gloo_device(address: str) -> Any:  # a torch._C gloo Device
    """A gloo device whose sockets listen on ``address`` only (for a standalone ``ProcessGroupGloo``)."""
    return dist.ProcessGroupGloo.create_device(hostname=address)


def gloo_options(address: str, timeout: timedelta) -> Any:  # ProcessGroupGloo._Options
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [gloo_device(address)]
    opts._timeout = timeout
    return opts


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` now (the socket is closed again at once)."""
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


#: set to 1 to keep a group's store listening (on its bound address) for the whole run instead of closing it
KEEP_OPEN_ENV = "HYBRID_RENDEZVOUS_KEEP_OPEN"


def open_store(
    host: str, port: int, world_size: int, *, is_master: bool, timeout: timedelta, what: str = "rendezvous"
) -> RendezvousStore:
    """A ``TCPStore`` at ``host:port``; on rank 0 (``is_master``) its server listens on ``host`` only."""
    if os.environ.get(KEEP_OPEN_ENV, "") in ("", "0"):
        # NCCL's heartbeat monitor polls the default group's store every second for another rank's "dump your
        # traces" flag (TORCH_NCCL_DUMP_ON_TIMEOUT). This store closes once the groups are formed
        # (close_when_formed), so every poll would only log "Failed to check the 'should dump' flag on TCPStore"
        # for the rest of the run; without the store no flag could come anyway. An explicit setting is kept.
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    if is_master:
        listener = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(max(128, world_size))
        except OSError as e:
            listener.close()
            raise RoleFailure(f"{what}: cannot listen on {host}:{port} ({e}).") from e
        # the store owns the socket from here on (closing the store closes it)
        store = dist.TCPStore(
            host,
            port,
            world_size,
            True,
            timeout,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
            use_libuv=True,
        )
    else:
        store = dist.TCPStore(host, port, world_size, False, timeout)
    wrapped = RendezvousStore(store, what)
    # The process groups keep the C++ half of a Python store; should its Python half be collected (a caller that
    # drops the returned store), their calls into it fail as "fn INTERNAL ASSERT FAILED ... Not implemented" (seen:
    # DeepSpeed's first broadcast in bench/trainer_gpu.py). Kept for the process's life: a few small objects.
    _OPENED.append(wrapped)
    return wrapped


_OPENED: list[RendezvousStore] = []


class _Store(Protocol):
    """The ``torch.distributed.Store`` methods :class:`RendezvousStore` forwards (a ``TCPStore`` has them)."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes: ...
    def delete_key(self, key: str) -> bool: ...
    def check(self, keys: list[str]) -> bool: ...
    def num_keys(self) -> int: ...
    def wait(self, keys: list[str], timeout: timedelta = ...) -> None: ...
    def set_timeout(self, timeout: timedelta) -> None: ...
    def clone(self) -> _Store: ...


# dist.Store is Any where torch is not installed (the lint env, mypy.ini): subclassing it is the point here
class RendezvousStore(dist.Store):  # type: ignore[misc]
    """A store that can be closed while the process groups made from it live on (they keep a reference to it):
    every call goes to the ``TCPStore`` until :meth:`close`, which drops the last reference, so rank 0's server
    stops listening. Calls after that fail naming why."""

    def __init__(self, store: _Store, what: str = "rendezvous"):
        super().__init__()
        self._store: _Store | None = store
        self.what = what

    @property
    def closed(self) -> bool:
        return self._store is None

    def _live(self) -> _Store:
        if self._store is None:
            raise RuntimeError(
                f"{self.what}: the rendezvous store was closed once the groups formed "
                f"(hybrid_core.rendezvous: it listens only while the ranks meet); a group made after "
                f"set-up cannot use it."
            )
        return self._store

    def close(self) -> None:
        self._store = None

    def close_when_formed(self, rank: int, world_size: int, *, key: str = "hybrid/formed") -> None:
        """Every rank calls this once it needs the store no more; rank 0 closes its server when all have (the
        others close their connections at once)."""
        done = f"{key}/all"
        if self.add(key, 1) == world_size:
            self.set(done, b"1")
        if rank == 0:
            self.wait([done])
        if os.environ.get(KEEP_OPEN_ENV, "") not in ("", "0"):  # a way back, should a library need the store later
            return
        self.close()

    # ---- torch's Store interface, forwarded ----------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        return self._live().set(key, value)

    def get(self, key: str) -> bytes:
        return self._live().get(key)

    def add(self, key: str, value: int) -> int:
        return self._live().add(key, value)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._live().compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._live().delete_key(key)

    def check(self, keys: list[str]) -> bool:
        return self._live().check(keys)

    def num_keys(self) -> int:
        return self._live().num_keys()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        return self._live().wait(keys) if timeout is None else self._live().wait(keys, timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        return self._live().set_timeout(timeout)

    def clone(self) -> RendezvousStore:
        return RendezvousStore(self._live().clone(), self.what)


def form_groups(device: torch.device) -> int:
    """Run one tiny collective on every process group of this process (in creation order, as every rank made
    them): NCCL builds a group's communicator -- through the store -- at its first collective, so after this no
    group needs the store. Returns the number of groups."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}).keys()) if world is not None else []
    for group in groups:
        on = device if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")
        dist.all_reduce(torch.zeros(1, device=on), group=group)
    return len(groups)


def _family(host: str) -> int:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host.strip("[]")).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET
