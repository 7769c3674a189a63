"""Plans on a real local Ray cluster with fake GPUs: one PACK group, one bundle per GPU, workers on their GPUs."""

import os
import random
import time

import pytest
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybrid_core.cluster import gpus_hidden_as_fakes
from hybrid_core.errors import PlacementError
from hybrid_core.placement import PlacementSpec, place
from hybrid_core.placement.ray_groups import GpuDevice, order_devices
from hybrid_core.remote import get_with_timeout

CLUSTER_GPUS = 48


def as_text(gpu_ids) -> list[str]:
    """Ray answers ids as ints or strings depending on the node's CUDA_VISIBLE_DEVICES (fake GPUs of a CPU run on a
    GPU machine are "-1", "-2", ...); the placement keeps numeric ones as ints. Compare them as text."""
    return [str(g) for g in gpu_ids]


TIMEOUT = 60


@pytest.fixture(scope="module")
def cluster():
    with gpus_hidden_as_fakes(CLUSTER_GPUS):  # GPUs hidden for a CPU run: Ray refuses fakes otherwise
        ray.init(address="local", num_cpus=4, num_gpus=CLUSTER_GPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def free_gpus():
    return ray.available_resources().get("GPU", 0)


def wait_for_free_gpus(expected, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while free_gpus() != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return free_gpus()


def role_actor_class():
    # Defined in a function so Ray pickles it by value (workers cannot import test modules).
    @ray.remote
    class RoleWorker:
        def __init__(self, role, rank):
            self.role, self.rank = role, rank

        def where(self):
            return self.role, self.rank, ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")

    return RoleWorker


@ray.remote(num_cpus=0)
def gpu_ids_here():
    return ray.get_gpu_ids()


def test_workers_land_on_their_planned_gpus_whatever_the_creation_order(cluster):
    # A GPU held by someone else: the group gets other devices, so plan GPU k is not device k.
    @ray.remote(num_gpus=1, num_cpus=0)
    class Blocker:
        def gpu(self):
            return ray.get_gpu_ids()[0]

    blocker = Blocker.remote()
    blocked = get_with_timeout(blocker.gpu.remote(), TIMEOUT, "blocker")
    plan = PlacementSpec.from_ranges({"actor": "0-3", "rollout": "0-3", "reference": "0-1"}, tp={"rollout": 2}).plan()
    placed = place(plan, timeout_s=TIMEOUT)
    try:
        ids = [placed.device(g).gpu_id for g in range(plan.num_gpus)]
        assert blocked not in ids and ids == sorted(ids) and len(set(ids)) == 4  # plan order = device order
        assert len({placed.device(g).bundle_index for g in range(4)}) == 4

        slots = [(name, w.rank) for name, role in plan.roles.items() for w in role.workers]
        random.Random(7).shuffle(slots)
        worker_cls = role_actor_class()
        workers = [worker_cls.options(**placed.actor_options(name, rank)).remote(name, rank) for name, rank in slots]
        answers = get_with_timeout([w.where.remote() for w in workers], TIMEOUT, "role workers: where")
        for name, rank, gpu_ids, visible in answers:
            first_gpu = plan.roles[name].workers[rank].gpus[0]
            assert as_text(gpu_ids) == as_text([placed.device(first_gpu).gpu_id]), (name, rank)
            assert visible == str(placed.device(first_gpu).gpu_id)

        # A tensor-parallel engine's other GPUs: the engine places its extra workers there by bundle index, with
        # the fraction the plan reserved for it on each of its GPUs.
        for engine in plan.roles["rollout"].workers:
            bundles = placed.bundle_indices("rollout", engine.rank)
            assert bundles == [placed.device(g).bundle_index for g in engine.gpus]
            refs = [
                gpu_ids_here.options(
                    num_gpus=engine.num_gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placed.placement_group, b),
                ).remote()
                for b in bundles[1:]
            ]
            found = get_with_timeout(refs, TIMEOUT, "engine bundles")
            assert [as_text(f) for f in found] == [as_text([placed.device(g).gpu_id]) for g in engine.gpus[1:]]

        # Same options in another order, as tasks once the actors are gone: same devices.
        for w in workers:
            ray.kill(w)
        random.Random(8).shuffle(slots)
        refs = [gpu_ids_here.options(**placed.actor_options(name, rank)).remote() for name, rank in slots]
        for (name, rank), gpu_ids in zip(slots, get_with_timeout(refs, TIMEOUT, "tasks")):
            assert as_text(gpu_ids) == as_text([placed.device(plan.roles[name].workers[rank].gpus[0]).gpu_id])
    finally:
        placed.remove()
        ray.kill(blocker)
    assert wait_for_free_gpus(CLUSTER_GPUS) == CLUSTER_GPUS  # the group and the blocker gave their GPUs back


def test_the_guides_48_gpu_layout_places_on_48_gpus(cluster):
    plan = PlacementSpec.from_ranges(
        {"actor": "0-15", "rollout": "0-15", "critic": "16-31", "reward": "32-39", "reference": "40-47"},
        tp={"rollout": 4},
        gpus_per_node=8,
        num_nodes=6,
    ).plan()
    with place(plan, timeout_s=TIMEOUT) as placed:
        assert free_gpus() == 0
        devices = [placed.device(g) for g in range(48)]
        assert len({d.bundle_index for d in devices}) == len({d.gpu_id for d in devices}) == 48
        for engine in plan.roles["rollout"].workers:
            ids = [placed.device(g).gpu_id for g in engine.gpus]
            assert ids == list(range(ids[0], ids[0] + 4))  # neighbouring devices for a TP engine
        options = placed.actor_options("critic", 3)
        assert options["num_gpus"] == 1 and options["num_cpus"] <= placed.cpus_per_gpu
        assert options["scheduling_strategy"].placement_group_bundle_index == placed.device(19).bundle_index
    assert wait_for_free_gpus(CLUSTER_GPUS) == CLUSTER_GPUS


def test_place_rejects_a_plan_larger_than_the_cluster(cluster):
    plan = PlacementSpec.from_ranges({"actor": "0-63"}).plan()
    with pytest.raises(PlacementError) as err:
        place(plan, timeout_s=5)
    assert err.value.field == "num_gpus"
    assert "needs 64 GPUs but the Ray cluster has 48" in str(err.value)


def test_place_gives_up_when_gpus_are_held_and_frees_the_group(cluster):
    @ray.remote(num_gpus=1, num_cpus=0)
    class Holder:
        def ready(self):
            return True

    holder = Holder.remote()
    get_with_timeout(holder.ready.remote(), TIMEOUT, "holder")
    plan = PlacementSpec.from_ranges({"actor": "0-47"}).plan()
    with pytest.raises(PlacementError) as err:
        place(plan, timeout_s=1)
    assert "not ready within 1 s" in str(err.value) and "47 of 48 GPUs free" in str(err.value)
    ray.kill(holder)
    assert wait_for_free_gpus(CLUSTER_GPUS) == CLUSTER_GPUS  # the pending group was removed


def test_plan_gpus_follow_node_then_device_order():
    found = [
        GpuDevice(0, "node-b", 3),
        GpuDevice(1, "node-b", 10),
        GpuDevice(2, "node-a", 1),
        GpuDevice(3, "node-b", 9),
        GpuDevice(4, "node-a", 0),
    ]
    ordered = order_devices(found)
    assert [(d.node_id, d.gpu_id) for d in ordered] == [
        ("node-b", 3),
        ("node-b", 9),
        ("node-b", 10),
        ("node-a", 0),
        ("node-a", 1),
    ]
    assert order_devices(list(reversed(found))) == ordered
