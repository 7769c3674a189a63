"""A plan on a live Ray cluster: one placement group (PACK, one ``{"GPU": 1, "CPU": c}`` bundle per GPU) and the
scheduling options that pin each worker to its bundle.

Which physical GPU a bundle gets is Ray's choice (and it is not bundle ``k`` -> GPU ``k`` when other jobs hold
GPUs). So after the group is ready, one tiny task per bundle reports its node and device id, and plan GPU ``k`` is
the k-th bundle in (node, device id) order: the plan's GPU numbers follow ``nvidia-smi`` order on each node, the
mapping never depends on the order workers are created in, and a tensor-parallel engine's consecutive plan GPUs are
neighbouring devices on one node (checked).

On several nodes the one group spans them (PACK fills a node before the next). When the plan has a node size
(``gpus_per_node``), each of its nodes must land within one real node (checked, with an error naming the plan node
and the real nodes it straddles); :meth:`PlacedPlan.layout` records which real node each plan GPU and each worker
got, for the run's logs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, PlacementError
from ..remote import get_with_timeout
from .plan import PlacementPlan, WorkerSlot
from .ranges import format_gpus

GpuId = int | str


@dataclass(frozen=True)
class GpuDevice:
    """Where a plan GPU landed: its bundle in the placement group, the node, and the device id Ray gave it."""

    bundle_index: int
    node_id: str
    gpu_id: GpuId


@dataclass
class PlacedPlan:
    """A plan with its placement group. Create it with :func:`place`; :meth:`remove` frees the GPUs."""

    plan: PlacementPlan
    placement_group: Any
    devices: tuple[GpuDevice, ...]  # indexed by plan GPU
    cpus_per_gpu: float
    _removed: bool = field(default=False, repr=False)

    def actor_options(self, role: str, rank: int, *, capture_child_tasks: bool | None = None) -> dict[str, Any]:
        """Keyword arguments for ``SomeActor.options(**...)`` that put worker ``rank`` of ``role`` on its GPU.

        ``num_gpus`` is the worker's fraction of its (first) GPU and ``num_cpus`` the same share of the bundle's
        CPUs. A tensor-parallel engine's actor lands on its first GPU; the engine places its other workers with
        :meth:`bundle_indices` (set ``capture_child_tasks`` if it creates them as plain child tasks/actors).
        """
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot = self.worker(role, rank)
        return {
            "num_gpus": slot.num_gpus,
            "num_cpus": _round_down(slot.num_gpus * self.cpus_per_gpu),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self.devices[slot.gpus[0]].bundle_index,
                placement_group_capture_child_tasks=capture_child_tasks,
            ),
        }

    def bundle_indices(self, role: str, rank: int) -> list[int]:
        """The bundle indices of a worker's GPUs, in plan order (several for a tensor-parallel engine)."""
        return [self.devices[g].bundle_index for g in self.worker(role, rank).gpus]

    def device(self, gpu: int) -> GpuDevice:
        """The bundle, node and device id of plan GPU ``gpu``."""
        return self.devices[gpu]

    def worker(self, role: str, rank: int) -> WorkerSlot:
        if role not in self.plan.roles:
            raise KeyError(f"no role {role!r} in the plan (roles: {', '.join(self.plan.roles)})")
        workers = self.plan.roles[role].workers
        if not 0 <= rank < len(workers):
            raise IndexError(f"{role} has ranks 0-{len(workers) - 1}, not {rank}")
        return workers[rank]

    def layout(self) -> dict[str, Any]:
        """Where everything landed: for each real node its IP and plan GPUs, for each worker its nodes (JSON-ready)."""
        import ray

        ips = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
        nodes: dict[str, dict[str, Any]] = {}
        for gpu, device in enumerate(self.devices):
            entry = nodes.setdefault(
                device.node_id, {"ip": ips.get(device.node_id, ""), "plan_gpus": [], "bundles": [], "device_ids": []}
            )
            entry["plan_gpus"].append(gpu)
            entry["bundles"].append(device.bundle_index)
            entry["device_ids"].append(device.gpu_id)
        roles = {
            name: [
                {"rank": w.rank, "plan_gpus": list(w.gpus), "nodes": sorted({self.devices[g].node_id for g in w.gpus})}
                for w in role.workers
            ]
            for name, role in self.plan.roles.items()
        }
        return {"gpus_per_node": self.plan.gpus_per_node, "nodes": nodes, "roles": roles}

    def remove(self) -> None:
        """Free the placement group (its GPUs go back to the cluster); safe to call twice."""
        if self._removed:
            return
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.placement_group)
        self._removed = True

    def __enter__(self) -> PlacedPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def place(
    plan: PlacementPlan, timeout_s: float = 60, *, cpus_per_gpu: float | None = None, name: str = ""
) -> PlacedPlan:
    """Reserve the plan's GPUs as one placement group and map plan GPUs to devices.

    ``cpus_per_gpu``: CPUs per bundle (shared by the workers on that GPU like the GPU itself); default
    ``min(1, free CPUs / GPUs)`` so a CPU-poor test cluster with fake GPUs still fits. Raises
    :class:`PlacementError` when the cluster has too few GPUs or the group is not ready within ``timeout_s``.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if not ray.is_initialized():
        raise ConfigError(
            "ray", "Ray is not running.", "Call hybrid_core.cluster.connect() (or ray.init) before placing a plan."
        )
    total_gpus = ray.cluster_resources().get("GPU", 0)
    if total_gpus < plan.num_gpus:
        raise PlacementError(
            "num_gpus",
            f"the plan needs {plan.num_gpus} GPUs but the Ray cluster has {total_gpus:g}.",
            "Shrink the plan (share GPUs between roles, fewer GPUs per role) or add nodes to the cluster.",
        )
    if cpus_per_gpu is None:
        free_cpus = ray.available_resources().get("CPU", 0.0)
        cpus_per_gpu = min(1.0, math.floor(100 * free_cpus / plan.num_gpus) / 100)
    elif cpus_per_gpu < 0:
        raise ConfigError("cpus_per_gpu", f"must be >= 0, got {cpus_per_gpu}.")
    bundle = {"GPU": 1, "CPU": cpus_per_gpu} if cpus_per_gpu > 0 else {"GPU": 1}
    pg = placement_group([dict(bundle) for _ in range(plan.num_gpus)], strategy="PACK", name=name)
    try:
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            free = ray.available_resources().get("GPU", 0)
            raise PlacementError(
                "num_gpus",
                f"the placement group of {plan.num_gpus} GPU bundles "
                f"({bundle}) was not ready within {timeout_s:g} s; the cluster has {free:g} of "
                f"{total_gpus:g} GPUs free.",
                "Free GPUs held by other jobs or actors, lower cpus_per_gpu if CPUs are short, or raise the timeout.",
            )
        devices = _discover_devices(pg, plan.num_gpus, timeout_s)
        _check_engines_on_one_node(plan, devices)
        _check_plan_nodes(plan, devices)
    except BaseException:
        remove_placement_group(pg)
        raise
    return PlacedPlan(plan=plan, placement_group=pg, devices=devices, cpus_per_gpu=cpus_per_gpu)


def _discover_devices(pg: Any, num_bundles: int, timeout_s: float) -> tuple[GpuDevice, ...]:
    """Ask each bundle for its node and GPU id; order bundles by (node, device id)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = _probe_task()
    refs = [
        probe.options(num_gpus=1 / _RAY_STEP, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
        for i in range(num_bundles)
    ]
    answers = get_with_timeout(refs, timeout_s, "placement: asking each bundle for its GPU id")
    found = []
    for index, (node_id, gpu_ids) in enumerate(answers):
        if len(gpu_ids) != 1:
            raise PlacementError(
                "num_gpus",
                f"bundle {index} reports GPU ids {gpu_ids}, expected exactly one.",
                "Check the node's CUDA_VISIBLE_DEVICES / Ray GPU resources.",
            )
        found.append(GpuDevice(index, node_id, _as_id(gpu_ids[0])))
    return order_devices(found)


def order_devices(found: list[GpuDevice]) -> tuple[GpuDevice, ...]:
    """Plan GPU order: nodes in the order of their first bundle (PACK fills the first node first), then device id
    within a node (numeric ids numerically: GPU 10 after GPU 9)."""
    first_bundle: dict[str, int] = {}
    for device in sorted(found, key=lambda d: d.bundle_index):
        first_bundle.setdefault(device.node_id, device.bundle_index)
    return tuple(sorted(found, key=lambda d: (first_bundle[d.node_id], _id_key(d.gpu_id))))


def _check_engines_on_one_node(plan: PlacementPlan, devices: tuple[GpuDevice, ...]) -> None:
    for name, role in plan.roles.items():
        for worker in role.workers:
            nodes = {devices[g].node_id for g in worker.gpus}
            if len(nodes) > 1:
                raise PlacementError(
                    f"{name}.tp",
                    f"{name} engine {worker.rank} (plan GPU "
                    f"{format_gpus(worker.gpus)}) landed on {len(nodes)} nodes: the cluster's "
                    "free GPUs are split across nodes at that point.",
                    "Free whole nodes for the job, or align the role's GPUs to node boundaries (gpus_per_node).",
                )


def _check_plan_nodes(plan: PlacementPlan, devices: tuple[GpuDevice, ...]) -> None:
    """Each node of the plan (``gpus_per_node`` consecutive plan GPUs) on one real node."""
    if not plan.gpus_per_node:
        return
    for start in range(0, plan.num_gpus, plan.gpus_per_node):
        gpus = range(start, min(start + plan.gpus_per_node, plan.num_gpus))
        nodes = sorted({devices[g].node_id for g in gpus})
        if len(nodes) > 1:
            raise PlacementError(
                "placement.gpus_per_node",
                f"plan node {start // plan.gpus_per_node} (plan GPUs "
                f"{format_gpus(tuple(gpus))}) landed on {len(nodes)} nodes "
                f"({', '.join(n[:8] for n in nodes)}): the cluster's free GPUs do not come in nodes "
                f"of {plan.gpus_per_node}.",
                "Give placement.gpus_per_node the GPUs each node really has free (or free whole nodes for the job).",
            )


_probe: Any = None  # the Ray remote function, made once
_RAY_STEP = 10_000


def _probe_task() -> Any:
    global _probe
    if _probe is None:
        import ray

        @ray.remote(num_cpus=0, max_retries=0)  # type: ignore[untyped-decorator]  # ray is Any in the lint env
        def probe_bundle() -> tuple[str, list[int]]:
            return ray.get_runtime_context().get_node_id(), list(ray.get_gpu_ids())

        _probe = probe_bundle
    return _probe


def _as_id(value: Any) -> GpuId:
    """Numeric ids as ints (the fake GPUs of a CPU run on a GPU machine are -1, -2, ...: cluster.py), others (UUIDs)
    as text."""
    text = str(value)
    return int(text) if re.fullmatch(r"-?[0-9]+", text) else text


def _id_key(gpu_id: GpuId) -> tuple[int, int, str]:
    return (0, gpu_id, "") if isinstance(gpu_id, int) else (1, 0, gpu_id)


def _round_down(value: float) -> float:
    return math.floor(value * _RAY_STEP + 1e-9) / _RAY_STEP
