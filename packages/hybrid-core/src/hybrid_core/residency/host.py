"""Host memory: what a residency plan keeps in each node's RAM, and whether that fits.

A plan puts three things in host memory, per node (a plan GPU's node is ``gpu // gpus_per_node``; all GPUs are one
node when the run does not say how large a node is):

* offloaded states: every (role, state) whose move is ``offload`` keeps a host copy of its bytes for each worker
  (pinned copies of a trainer's params / grads / optimizer state, of a frozen model's params, and an engine's weights
  on a level-1 sleep, which vLLM backs up to host). They are counted all at once, not per phase: torch's pinned
  memory allocator keeps its buffers cached after a state goes back to the GPU. ``discard`` and ``release`` keep
  nothing on host;
* the optimizer in host memory (DeepSpeed CPU Adam: the planner's ``host`` move, or ``trainer.adam_offload``): master
  weights and their gradients, Adam m and v, and a model-dtype partition: 18 bytes per parameter of the rank's ZeRO
  partition (fp32 master weights and moments), 14 with bf16 master weights, 10 with bf16 moments too, plus DeepSpeed's
  staging buffers (the memory model's ``cpu_adam_bytes``, ``RoleSize.host`` / ``RoleSize.host_optimizer``);
* the processes: every worker, and the driver on node 0, is a Python process with torch and the CUDA libraries
  loaded, ``PROCESS_BYTES`` each (an estimate).

The first two are what the plan decides: a plan whose states exceed a node's memory is refused before anything
starts (the kernel's or Ray's OOM killer would otherwise end the run minutes into start-up), and so is one whose
states (a GiB or more) and processes together exceed it; the process estimate alone never refuses a plan, and adds a
note when the total comes near the capacity. The capacity of this machine leaves out the share of its memory Ray's
memory monitor keeps (it kills a worker above 95 % of the total in use).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import PlacementError
from .memory import CPU_ADAM, GiB, GpuShare

#: Host memory of one worker process whatever the plan keeps there: the Python interpreter, torch, the CUDA runtime,
#: cuBLAS / cuDNN / NCCL mapped in, Ray's worker machinery. An estimate: a 6.5B model's run on one H100 held ~12 GiB
#: besides its CPU Adam state, for four processes and Ray's own (2026-11-24). It refuses a plan only together with
#: states the plan keeps in host memory (:data:`STATES_THAT_COUNT`), never alone.
PROCESS_BYTES = 3 * GiB
#: Plans keeping less than this in a node's host memory are never refused for the process estimate.
STATES_THAT_COUNT = 1 * GiB
#: Above this fraction of a node's capacity (states + the process estimate), the plan says the run is tight.
NEAR_FULL = 0.9


@dataclass(frozen=True)
class HostBudget:
    """The host memory each node may fill, and where the number comes from."""

    bytes: float | None  # per node; None: unknown (nothing is checked, the plan's notes say so)
    source: str  # shown with the number: the setting that gave it, "MemAvailable of this machine", or why unknown
    gpus_per_node: int | None = None  # plan GPU -> node; None: one node
    local: bool = False  # read from this machine: other nodes are assumed to have as much


@dataclass
class HostUse:
    """What one node's host memory holds under a plan."""

    node: int
    #: (role, item) -> bytes; item: CPU_ADAM (the optimizer in host memory) or the name of an offloaded state
    items: dict[tuple[str, str], float] = field(default_factory=dict)
    processes: int = 0

    @property
    def optimizer(self) -> float:
        """CPU Adam's state (fp32 master, m, v, fp32 grads) of the ranks on this node."""
        return sum(v for (_, item), v in self.items.items() if item == CPU_ADAM)

    @property
    def offloaded(self) -> float:
        return sum(v for (_, item), v in self.items.items() if item != CPU_ADAM)

    @property
    def states(self) -> float:
        """What the plan decides to keep here (the refusal compares this with the capacity)."""
        return self.optimizer + self.offloaded

    @property
    def process_bytes(self) -> float:
        return self.processes * PROCESS_BYTES

    @property
    def total(self) -> float:
        return self.states + self.process_bytes


def host_use(
    layout: Mapping[int, tuple[GpuShare, ...]],
    moves: Mapping[tuple[str, str], str],
    gpus_per_node: int | None = None,
    *,
    driver: bool = True,
) -> dict[int, HostUse]:
    """Node -> what its host memory holds: offloaded states x workers, CPU Adam's partitions, one process per worker
    (and the driver on node 0 unless ``driver`` is off). A pure function of the layout and the moves."""
    nodes: dict[int, HostUse] = {}
    for gpu, shares in sorted(layout.items()):
        node = gpu // gpus_per_node if gpus_per_node else 0
        use = nodes.setdefault(node, HostUse(node))
        for share in shares:
            size, n = share.size, share.workers
            held = {
                state: nbytes
                for state, nbytes in size.states.items()
                if nbytes and moves.get((size.role, state), "resident") == "offload"
            }
            held.update(size.host)  # kept there for the whole run (CPU Adam with trainer.adam_offload)
            if moves.get((size.role, "optimizer")) == "host" and CPU_ADAM not in size.host:
                held[CPU_ADAM] = size.host_optimizer  # the planner keeps the optimizer there
            for item, nbytes in held.items():
                if nbytes:
                    use.items[(size.role, item)] = use.items.get((size.role, item), 0.0) + nbytes * n
            use.processes += n
    if driver and nodes:
        nodes[min(nodes)].processes += 1
    return nodes


def _meminfo(field: str, meminfo: str) -> float | None:
    """One ``/proc/meminfo`` field in bytes, or None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return float(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(meminfo: str = "/proc/meminfo") -> float | None:
    """This machine's available memory in bytes (Linux ``MemAvailable``: free memory plus what the kernel can reclaim
    without swapping), or None where it cannot be read."""
    return _meminfo("MemAvailable", meminfo)


def total_memory(meminfo: str = "/proc/meminfo") -> float | None:
    """This machine's ``MemTotal`` in bytes, or None."""
    return _meminfo("MemTotal", meminfo)


def ray_kill_threshold(environ: Mapping[str, str] | None = None) -> float:
    """The fraction of a node's memory above which Ray's memory monitor kills workers (``RAY_memory_usage_threshold``,
    0.95 by default; 1.0 when the monitor is off, ``RAY_memory_monitor_refresh_ms=0``)."""
    environ = os.environ if environ is None else environ
    if environ.get("RAY_memory_monitor_refresh_ms", "").strip() == "0":
        return 1.0
    try:
        return min(1.0, max(0.0, float(environ.get("RAY_memory_usage_threshold", "0.95"))))
    except ValueError:
        return 0.95


def local_budget(
    gpus_per_node: int | None = None, *, meminfo: str = "/proc/meminfo", environ: Mapping[str, str] | None = None
) -> HostBudget:
    """The default budget: what this machine has available now, less the share of its memory that Ray's memory
    monitor never lets workers use (it kills one above ``threshold x MemTotal`` in use: the 7B run of 2026-11-24
    was killed at 95 % with 4 GiB still free)."""
    found = available_memory(meminfo)
    if found is None:
        reason = (
            f"this machine's available memory could not be read ({meminfo} has no MemAvailable)"
            if os.path.exists(meminfo)
            else f"this machine's available memory is unknown (no {meminfo})"
        )
        return HostBudget(None, reason, gpus_per_node, local=True)
    total, threshold = total_memory(meminfo), ray_kill_threshold(environ)
    if total is None or threshold >= 1.0:
        return HostBudget(found, "MemAvailable of this machine", gpus_per_node, local=True)
    reserve = (1.0 - threshold) * total
    return HostBudget(
        max(0.0, found - reserve),
        f"MemAvailable of this machine less the {reserve / GiB:.1f} GiB Ray's "
        f"memory monitor keeps (it kills workers above {threshold:.0%} of MemTotal)",
        gpus_per_node,
        local=True,
    )


def planning_budget(
    gpus_per_node: int | None,
    node_gpus: int,
    local_gpus: int,
    *,
    runs_here: bool = False,
    meminfo: str = "/proc/meminfo",
    environ: Mapping[str, str] | None = None,
) -> HostBudget:
    """The budget a dry-run checks a plan against when ``residency.host_memory_gb`` is not given.

    A dry-run plans for the run's nodes, which are often not the machine it runs on (a laptop checking a 64-GPU
    script): this machine's memory says something about theirs only when it could be one of them -- it has the
    ``node_gpus`` GPUs the fullest node of the plan uses (``local_gpus`` >= ``node_gpus``), or the run is a local one
    (``runs_here``: a local Ray declaring its GPUs). Otherwise nothing is checked, and the plan says what it keeps in
    each node's host memory (:func:`render_host`, :func:`host_notes`), for ``residency.host_memory_gb`` to check."""
    if runs_here or local_gpus >= node_gpus:
        return local_budget(gpus_per_node, meminfo=meminfo, environ=environ)
    return HostBudget(
        None,
        f"a dry-run plans for the run's nodes, and this machine has {local_gpus} of the "
        f"{node_gpus} GPUs one of them uses, so its memory says nothing about theirs",
        gpus_per_node,
    )


# ---- the check, the notes and the lines --------------------------------------------------------------------------
# Each takes a plan's budget (``ResidencyPlan.host``) and what it keeps per node (``ResidencyPlan.host_use()``).
def check_host(budget: HostBudget | None, uses: Mapping[int, HostUse]) -> None:
    """Raise a :class:`PlacementError` naming the node, the numbers, the largest items and a fix when the states a
    plan keeps in a node's host memory (``uses``) exceed its capacity."""
    if budget is None or budget.bytes is None:
        return
    for node, use in sorted(uses.items()):
        if not refused(use, budget.bytes):
            continue
        parts = ", ".join(f"{_item(role, item)} {v / GiB:.1f}" for (role, item), v in _largest(use)[:4])
        over = (
            f"the plan keeps {use.states / GiB:.1f} GiB in host memory > {budget.bytes / GiB:.1f} GiB available "
            f"({budget.source}): {parts} GiB; the {use.processes} processes need about "
            f"{use.process_bytes / GiB:.0f} GiB more (an estimate)"
            if use.states > budget.bytes
            else f"the plan keeps {use.states / GiB:.1f} GiB in host memory ({parts} GiB) and its {use.processes} "
            f"processes need about {use.process_bytes / GiB:.0f} GiB more (an estimate): "
            f"{use.total / GiB:.1f} GiB > {budget.bytes / GiB:.1f} GiB available ({budget.source})"
        )
        raise PlacementError(
            "residency.host_memory_gb",
            f"node {node}: {over}. The run would be killed for memory at start-up.",
            _fix(use, budget),
        )


def host_notes(budget: HostBudget | None, uses: Mapping[int, HostUse]) -> list[str]:
    """What a plan says about host memory: a node near its capacity, capacity unknown, other nodes assumed alike."""
    if budget is None:
        return []
    notes = []
    if budget.bytes is None:
        most = max((u.states for u in uses.values()), default=0.0)
        notes.append(
            f"host memory not checked: {budget.source} (the plan keeps up to {most / GiB:.1f} GiB of states "
            "in one node's host memory); set residency.host_memory_gb to check it"
        )
        return notes
    if budget.local and len(uses) > 1:
        others = sorted(uses)[1:]
        which = f"node {others[0]} is" if len(others) == 1 else f"nodes {_span(others)} are"
        notes.append(
            f"host memory: {which} assumed to have as much available as this machine "
            f"({budget.bytes / GiB:.1f} GiB); set residency.host_memory_gb if they differ"
        )
    for node, use in sorted(uses.items()):
        if use.states <= budget.bytes < use.total / NEAR_FULL:
            less = (
                "keep fewer states there (residency.pins)"
                if use.states > use.process_bytes
                else "run fewer worker processes per node (each role on a GPU is a process)"
            )
            notes.append(
                f"host (node {node}): {use.states / GiB:.1f} GiB of states + ~{use.process_bytes / GiB:.0f} "
                f"GiB for {use.processes} processes (an estimate) = {use.total / GiB:.1f} GiB, "
                + ("more than" if use.total > budget.bytes else f"over {NEAR_FULL:.0%} of")
                + f" the {budget.bytes / GiB:.1f} GiB available ({budget.source}): the "
                f"run may be killed for memory; free host memory, or {less}"
            )
    return notes


def refused(use: HostUse, capacity: float) -> bool:
    """Whether :func:`check_host` refuses a node: its states exceed the capacity, or states that count (a GiB or
    more) and the process estimate together do."""
    return use.states > capacity or (use.states >= STATES_THAT_COUNT and use.total > capacity)


def verdict(use: HostUse, capacity: float) -> str:
    """One word (or phrase) on a node's line, true to the numbers it follows (the total against the capacity):
    ``OVER`` (refused), over by the process estimate alone (not refused, see the module docstring), ``tight``
    (above :data:`NEAR_FULL`) or ``ok``."""
    if refused(use, capacity):
        return "OVER"
    if use.total > capacity:
        return "over by the process estimate (not refused)"
    return "tight" if use.total > NEAR_FULL * capacity else "ok"


def render_host(budget: HostBudget | None, uses: Mapping[int, HostUse]) -> list[str]:
    """One line per group of nodes holding the same: what is in host memory against what is available."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for node, use in sorted(uses.items()):
        groups.setdefault((round(use.optimizer), round(use.offloaded), use.processes), []).append(node)
    lines = []
    for nodes in groups.values():
        use = uses[nodes[0]]
        where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {_span(nodes)}, each"
        if budget is None or budget.bytes is None:
            capacity, source = "needed (available memory unknown: not checked)", ""
        else:
            flag = verdict(use, budget.bytes)
            capacity, source = f"of {budget.bytes / GiB:.1f} GiB available, {flag}", f"; available: {budget.source}"
        lines.append(
            f"host ({where}): {use.total / GiB:.1f} GiB {capacity}: optimizer (CPU Adam) "
            f"{use.optimizer / GiB:.1f}, offloaded {use.offloaded / GiB:.1f}, processes "
            f"~{use.process_bytes / GiB:.0f} ({use.processes} x {PROCESS_BYTES / GiB:g} GiB, estimated)" + source
        )
    return lines


def host_dict(budget: HostBudget | None, uses: Mapping[int, HostUse]) -> dict[str, Any]:
    """The numbers of :func:`render_host` for ``residency.json`` (bytes)."""
    return {
        "available": budget.bytes if budget else None,
        "source": budget.source if budget else None,
        "process_bytes_estimate": PROCESS_BYTES,
        "nodes": {
            str(node): {
                "optimizer_cpu_adam": u.optimizer,
                "offloaded": u.offloaded,
                "states": u.states,
                "processes": u.processes,
                "process_bytes": u.process_bytes,
                "total": u.total,
                "items": {f"{role}.{item}": v for (role, item), v in u.items.items()},
            }
            for node, u in sorted(uses.items())
        },
    }


def _largest(use: HostUse) -> list[tuple[tuple[str, str], float]]:
    return sorted(use.items.items(), key=lambda kv: -kv[1])


def _item(role: str, item: str) -> str:
    return f"{role} optimizer (CPU Adam)" if item == CPU_ADAM else f"{role} {item} (offloaded)"


def _fix(use: HostUse, budget: HostBudget) -> str:
    (role, item), _ = _largest(use)[0]
    if item == CPU_ADAM:
        fix = (
            f"The {role}'s optimizer is in host memory (CPU Adam: 18 bytes per parameter of each rank's ZeRO "
            "partition, 10 in bf16). Give it room on the GPUs so it stays there: more GPUs for the role with "
            "trainer.zero_stage 3 (each rank holds 1/N of the states) or larger GPUs, and no trainer.adam_offload; "
            "or keep it in bf16, if not already (trainer.bf16_master_weights trainer.bf16_optimizer_states: 6 bytes "
            "per parameter on the "
            "GPU instead of 12, 10 in host memory); or spread its ranks over more nodes (a node holds only its own "
            "ranks' partitions; ZeRO-0 would keep the whole optimizer on every rank)."
        )
    elif item == "weights":  # only engines have weights (a model's are its params)
        fix = (
            f"Let the engines drop their weights instead of backing them up to host (residency.pins "
            f"{role}.weights=discard, or engine.sleep_level 2: the sync refills them after each update)."
        )
    else:
        fix = (
            f"Keep fewer states in host memory: residency.pins {role}.{item}=resident where the GPU has room, "
            "or colocate fewer roles on the GPUs."
        )
    more = " (they are not this machine? say how much they have: residency.host_memory_gb N)" if budget.local else ""
    return f"{fix} Or run on nodes with more host memory{more}."


def _span(nodes: Iterable[int]) -> str:
    from ..placement.ranges import format_gpus

    return format_gpus(nodes)
