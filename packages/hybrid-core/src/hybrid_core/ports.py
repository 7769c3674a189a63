"""TCP ports for inference engines side by side: one window of ports per engine, disjoint on each node.

Why: vLLM and SGLang pick some ports from fixed starting points that are the same in every engine process. vLLM
0.26's Ray executor starts its TCPStore search at ``VLLM_DP_MASTER_PORT + 100 + 32 x local DP rank``
(``RayExecutorV2._select_tcpstore_port``); with one vLLM instance per engine both are 0, so two TP = 2 engines on one
node both probed port 100, both found it free, and the second TCPStore failed with ``EADDRINUSE``. SGLang's
DP-attention ports derive from its ``port`` (30000 for everyone). Other ports come from binding port 0 and race more
rarely. So each engine gets its own window ``[start, start + size)`` and its adapter points every port setting its
library reads into it (``vllm_engine.vllm_port_env``, ``sglang_engine.sglang_port_args``). A port is a (node,
number) pair: engines on different nodes reuse the same numbers.

Checked before any engine starts (:func:`check_windows`), with a :class:`ConfigError` naming both sides of a clash:

* no two windows of one node overlap;
* no window holds a port another part of the job listens on: Ray's ports (each node's from ``ray.nodes()``, the
  GCS port, and the fixed defaults of ``ray start``: 6379, 8265, 10001 and the worker ports 10002-19999 -- a cluster
  started with another ``--min-worker-port``/``--max-worker-port`` must keep its windows clear itself), and ports the
  caller reserves (:class:`Reserved`: a trainer rendezvous or weight-sync master port it chose by number);
* no window overlaps the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, read on the driver:
  the nodes of one cluster are assumed alike). Every socket bound to port 0 gets a port from there -- the trainer's
  rendezvous and weight-sync master ports (``free_port()``), Ray's random ports, the ports vLLM/SGLang do not take
  from the window -- so a window outside it never meets them.

The windows start at ``HYBRID_ENGINE_BASE_PORT`` (default 20000, just above Ray's worker ports and below the usual
ephemeral range 32768-60999); the k-th engine of a node takes ``base + k x size``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

BASE_PORT_ENV = "HYBRID_ENGINE_BASE_PORT"
DEFAULT_BASE_PORT = 20000
#: ports per engine window (each adapter says how many it needs: ``PORTS_NEEDED``; a larger need widens every window)
DEFAULT_WINDOW = 256
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_THIS_MACHINE = object()  # plan_engine_ports: read the ephemeral range here


@dataclass(frozen=True)
class PortWindow:
    """Ports ``start`` .. ``start + size - 1`` on ``node`` (a Ray node id), for ``owner`` ("rollout engine 0")."""

    owner: str
    node: str
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    def port(self, offset: int) -> int:
        """The window's ``offset``-th port (an adapter's layout: its library's settings at fixed offsets)."""
        if not 0 <= offset < self.size:
            raise ConfigError(
                BASE_PORT_ENV,
                f"{self.owner} needs port offset {offset} in its window of {self.size} ports.",
                "Give the engines wider windows (the adapter's PORTS_NEEDED).",
            )
        return self.start + offset

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.start <= port < self.stop

    def overlaps(self, first: int, last: int) -> bool:
        return self.start <= last and first < self.stop

    def __str__(self) -> str:
        return f"{self.owner} (ports {self.start}-{self.stop - 1} on node {_short(self.node)})"


@dataclass(frozen=True)
class Reserved:
    """Ports ``first`` .. ``last`` that ``what`` listens on, on ``node`` (None: on every node, or unknown)."""

    first: int
    last: int
    what: str
    node: str | None = None

    @classmethod
    def port(cls, port: int, what: str, node: str | None = None) -> Reserved:
        return cls(int(port), int(port), what, node)

    @classmethod
    def window(cls, window: PortWindow) -> Reserved:
        """Another engine group's window (a second ``launch_engines`` beside a running group reserves its
        ``port_windows``)."""
        return cls(window.start, window.stop - 1, window.owner, window.node)

    def __str__(self) -> str:
        ports = f"port {self.first}" if self.first == self.last else f"ports {self.first}-{self.last}"
        where = "every node" if self.node is None else f"node {_short(self.node)}"
        return f"{self.what} ({ports} on {where})"


#: Ray's fixed default ports (``ray start``): taken whatever the cluster, so always reserved.
RAY_DEFAULTS = (
    Reserved.port(6379, "Ray's default GCS port"),
    Reserved.port(8265, "Ray's default dashboard port"),
    Reserved.port(10001, "Ray's default client server port"),
    Reserved(10002, 19999, "Ray's default worker ports (ray start --min-worker-port/--max-worker-port)"),
    Reserved.port(52365, "Ray's default dashboard agent port"),
)
#: ``ray.nodes()`` entries that are ports a node's Ray processes listen on
RAY_NODE_PORT_KEYS = (
    "NodeManagerPort",
    "ObjectManagerPort",
    "MetricsExportPort",
    "MetricsAgentPort",
    "DashboardAgentListenPort",
    "RuntimeEnvAgentPort",
)


def base_port(environ: Mapping[str, str] | None = None) -> int:
    """The first port of the first window on each node: ``HYBRID_ENGINE_BASE_PORT`` or 20000."""
    environ = os.environ if environ is None else environ
    text = environ.get(BASE_PORT_ENV, "").strip()
    if not text:
        return DEFAULT_BASE_PORT
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1024 <= value <= 65535:
        raise ConfigError(
            BASE_PORT_ENV,
            f"must be a TCP port number in 1024-65535, got {text!r}.",
            f"Unset it (default {DEFAULT_BASE_PORT}) or give a free, unprivileged port range's start.",
        )
    return value


def allocate_windows(
    engines: Sequence[tuple[str, str]], *, base: int = DEFAULT_BASE_PORT, size: int = DEFAULT_WINDOW
) -> list[PortWindow]:
    """One window per ``(owner, node)``, in order: the k-th engine of a node gets ``base + k x size`` (numbers repeat
    on other nodes). Not checked against anything: see :func:`check_windows`."""
    if not isinstance(size, int) or size < 1:
        raise ConfigError("size", f"a port window needs at least one port, got {size!r}.")
    taken: dict[str, int] = {}
    windows = []
    for owner, node in engines:
        k = taken.get(node, 0)
        taken[node] = k + 1
        windows.append(PortWindow(owner, node, base + k * size, size))
    return windows


def check_windows(
    windows: Sequence[PortWindow], reserved: Iterable[Reserved] = (), ephemeral: tuple[int, int] | None = None
) -> None:
    """Refuse windows that leave the port range, overlap on a node, hold a reserved port or meet the ephemeral
    range (see the module docstring). Nothing is probed: a port something else already holds is found by the
    engine's own bind, inside its window."""
    first = min((w.start for w in windows), default=0)
    fix = f"Move the windows with {BASE_PORT_ENV}=<port> (they start at {first} now)."
    for w in windows:
        if w.start < 1024 or w.stop - 1 > 65535:
            raise ConfigError(BASE_PORT_ENV, f"{w} leaves the unprivileged TCP ports 1024-65535.", fix)
    for i, a in enumerate(windows):
        for b in windows[i + 1 :]:
            if a.node == b.node and a.overlaps(b.start, b.stop - 1):
                raise ConfigError(
                    BASE_PORT_ENV,
                    f"{a} and {b} share ports on one node.",
                    "Give every engine of a node its own window (allocate_windows does).",
                )
    for w in windows:
        for r in reserved:
            if (r.node is None or r.node == w.node) and w.overlaps(r.first, r.last):
                raise ConfigError(BASE_PORT_ENV, f"{w} holds a port of {r}.", fix)
        if ephemeral is not None and w.overlaps(*ephemeral):
            raise ConfigError(
                BASE_PORT_ENV,
                f"{w} overlaps the kernel's ephemeral ports {ephemeral[0]}-"
                f"{ephemeral[1]} ({EPHEMERAL_RANGE_FILE}), where every port-0 bind lands: the "
                "trainer's rendezvous and weight-sync ports, Ray's random ports.",
                f"Move the windows below {ephemeral[0]} or above {ephemeral[1]} with "
                f"{BASE_PORT_ENV}=<port> (they start at {first} now).",
            )


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """The kernel's ephemeral port range on this machine (None where it cannot be read, e.g. not Linux)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return low, high


def ray_reserved_ports(
    nodes: Sequence[Mapping[str, Any]] | None = None, gcs_address: str | None = None
) -> list[Reserved]:
    """Ray's ports: the fixed defaults, each node's own (``ray.nodes()``: node manager, object manager, metrics and
    agents) and the GCS port (``ray.get_runtime_context().gcs_address``). Without arguments, of the running cluster."""
    if nodes is None or gcs_address is None:
        import ray

        nodes = ray.nodes() if nodes is None else nodes
        if gcs_address is None:
            gcs_address = getattr(ray.get_runtime_context(), "gcs_address", None)
    out = list(RAY_DEFAULTS)
    for node in nodes:
        if not node.get("Alive", True):
            continue
        for key in RAY_NODE_PORT_KEYS:
            port = node.get(key)
            if isinstance(port, int) and port > 0:
                out.append(Reserved.port(port, f"Ray's {key}", node.get("NodeID")))
    if gcs_address and gcs_address.rsplit(":", 1)[-1].isdigit():
        out.append(Reserved.port(int(gcs_address.rsplit(":", 1)[-1]), "Ray's GCS"))
    return out


def check_port_env(env: Mapping[str, str], names: Iterable[str], backend: str) -> None:
    """Refuse a port variable that every engine would inherit alike (``runtime_env`` forwards ``VLLM_*`` and
    ``SGLANG_*`` from the driver to every worker): it would put all engines on one port."""
    shared = [n for n in names if n in env]
    if shared:
        raise ConfigError(
            shared[0],
            f"is set for every {backend} engine ({', '.join(f'{n}={env[n]}' for n in shared)}"
            "), but engines side by side need ports of their own; hybrid gives each engine its own "
            "window and sets it.",
            f"Unset {' and '.join(shared)}; move the windows with {BASE_PORT_ENV}=<port>.",
        )


def plan_engine_ports(
    engines: Sequence[tuple[str, str]],
    *,
    needed: int,
    environ: Mapping[str, str],
    reserved: Iterable[Reserved] = (),
    ray_ports: Iterable[Reserved] | None = None,
    ephemeral: Any = _THIS_MACHINE,
) -> list[PortWindow]:
    """Checked windows for ``engines`` (``(owner, node)`` each) that need ``needed`` ports each: the one call an
    engine launcher makes. ``ray_ports``: default those of the running cluster; ``ephemeral``: ``(low, high)`` or None
    (unknown), default this machine's range."""
    size = max(DEFAULT_WINDOW, int(needed))
    windows = allocate_windows(engines, base=base_port(environ), size=size)
    ray_ports = ray_reserved_ports() if ray_ports is None else ray_ports
    check_windows(windows, [*ray_ports, *reserved], ephemeral_range() if ephemeral is _THIS_MACHINE else ephemeral)
    return windows


def engine_windows(
    placed: Any,
    role: str,
    engine_cls: type,
    backend: str,
    environ: Mapping[str, str],
    engine_kwargs: Mapping[str, Any],
    reserved: Iterable[Reserved] = (),
) -> list[PortWindow] | None:
    """Engine ``r`` of ``role``'s checked window, on the node of its first plan GPU (``placed``: a
    :class:`~hybrid_core.placement.PlacedPlan`); None for an engine class that opens no ports of its own (no
    ``PORTS_NEEDED``). ``environ``: the engines' environment (``HYBRID_ENGINE_BASE_PORT``; the class's ``PORT_ENV``
    variables are refused there, see :func:`check_port_env`)."""
    needed = getattr(engine_cls, "PORTS_NEEDED", 0)
    if not needed:
        return None
    if "ports" in engine_kwargs:
        raise ConfigError(
            "ports",
            "the engine kwargs give every engine the same port window.",
            f"Drop 'ports': each engine gets its own; move them with {BASE_PORT_ENV}=<port>.",
        )
    check_port_env(environ, getattr(engine_cls, "PORT_ENV", ()), backend)
    engines = [(f"{role} engine {w.rank}", placed.devices[w.gpus[0]].node_id) for w in placed.plan.roles[role].workers]
    return plan_engine_ports(engines, needed=needed, environ=environ, reserved=reserved)


def _short(node: str) -> str:
    return node[:12] if len(node) > 16 else node
