"""The residency owner's wakes under the wake guard, on a real local Ray (the moves are Ray calls), with scripted GPU
readings (this machine has no CUDA to read).

Two ways a wake meets a full GPU: the check sees it first (the guard's error before any wake is tried), or another
process takes the memory between the check and the wake (seen on an H200 with a process grabbing what a sleep
freed): the wake's own out-of-memory error then becomes the guard's error, naming the processes on the GPU.
"""

import pytest
from ppo_phases import plan_residency

from hybrid_core.errors import GpuMemoryError
from hybrid_core.gpu_memory import GIB, GpuMemory, is_out_of_memory
from hybrid_core.residency import GpuShare, ResidencyOwner, RoleSize, WakeGuard

HOG = "pid 16484 (python) 136000 MiB"


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from hybrid_core.cluster import connect

    connect(num_cpus=1)
    yield ray
    ray.shutdown()


class Handle:
    """A role whose moves are Ray calls that report 40 GiB (or fail the way ``failure`` says)."""

    def __init__(self, ray, role, failure=None):
        self.ray, self.role, self.gpus, self.failure, self.calls = ray, role, [0], failure, []

    def _ref(self, what):
        self.calls.append(what)
        if self.failure is not None and what.startswith("on"):
            failure = self.failure

            @self.ray.remote
            def fail():
                raise failure

            return [(f"{self.role}: wake_up", fail.remote())]
        return [(f"{self.role}: {what}", self.ray.put({"bytes": 40 * GIB}))]

    def offload(self, states, moves):
        return self._ref("off " + "+".join(states))

    def reload(self, states):
        return self._ref("on " + "+".join(states))


class ScriptedGuard(WakeGuard):
    """A WakeGuard whose GPU readings come from a list (each read takes the next one; the last one repeats)."""

    def __init__(self, readings, holders):
        super().__init__({0: ("actor rank 0", None)}, holders)
        self.readings = list(readings)

    def read(self, gpu):
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


class Turns:
    def __init__(self):
        self.events = []

    def acquire(self, role, gpus, timeout_s=None):
        self.events.append(("acquire", role))

    def release(self, role, gpus):
        self.events.append(("release", role))


def free(gib, processes=None):
    return GpuMemory(free=int(gib * GIB), total=140 * GIB, processes=processes)


def owner_for(ray, readings, failure=None):
    """One GPU, an actor and an engine that both sleep (all-sleep): generate needs the engine, actor_train the actor."""
    actor = RoleSize("actor", "trainer", {"params": 10 * GIB, "grads": 10 * GIB, "optimizer": 20 * GIB, "cache": 0.0})
    engine = RoleSize("rollout", "engine", {"weights": 10 * GIB, "kv_cache": 30 * GIB})
    plan = plan_residency({0: (GpuShare(actor), GpuShare(engine))}, 140 * GIB, mode="all-sleep")
    handles = {"actor": Handle(ray, "actor", failure), "rollout": Handle(ray, "rollout")}
    turns = Turns()
    owner = ResidencyOwner(plan, handles, turnstile=turns, timeout_s=30, overlap=False)
    owner.guard = ScriptedGuard(readings, owner.holders)
    return owner, handles, turns


def test_the_check_stops_a_wake_before_it_is_tried(ray_local):
    owner, handles, _ = owner_for(ray_local, [free(100), free(60)])
    owner.enter("generate")  # the actor leaves (no wake)
    owner.enter("actor_train")  # its first wake: 100 GiB free before, 60 after: it took 40
    assert owner.guard.woke[("actor", "params+grads+optimizer")] == {0: 40 * GIB}
    owner.guard.readings = [free(100)]
    owner.enter("sync")
    owner.enter("generate")
    owner.guard.readings = [free(2, HOG)]  # a neighbour took the GPU
    tried = len(handles["actor"].calls)
    with pytest.raises(GpuMemoryError) as e:
        owner.enter("actor_train")
    assert len(handles["actor"].calls) == tried  # never asked to wake
    assert "actor cannot wake on GPU 0: it needs 40.00 GiB" in str(e.value) and "16484" in str(e.value)


def test_memory_taken_after_the_check_gives_the_guards_error_not_the_oom(ray_local):
    oom = RuntimeError("actor rank 0: reload: raised RuntimeError: CUDA Error: out of memory at cumem.cpp:163")
    owner, _, turns = owner_for(ray_local, [free(100), free(0.25, HOG)], failure=oom)
    owner.enter("generate")
    with pytest.raises(GpuMemoryError) as e:
        owner.enter("actor_train")
    text = str(e.value)
    assert text.startswith("actor cannot wake on GPU 0: it needs 40.00 GiB")  # the plan's bytes: no wake measured
    assert "0.25 GiB of 140.00 GiB is free" in text and "processes on the GPU: pid 16484" in text
    assert "the wake ran out of memory (" in text and "CUDA Error: out of memory" in text
    assert e.value.__cause__ is not None  # the original stays attached for the traceback
    assert turns.events[-2:] == [("acquire", "actor"), ("release", "actor")]  # the failed phase gave its turn back


def test_other_wake_failures_pass_through_unchanged(ray_local):
    owner, _, _ = owner_for(ray_local, [free(100)], failure=TimeoutError("reload did not answer within 5 s"))
    owner.enter("generate")
    with pytest.raises(Exception) as e:
        owner.enter("actor_train")
    assert not isinstance(e.value, GpuMemoryError) and "did not answer" in str(e.value)


def test_holders_are_what_the_owner_knows_to_be_resident(ray_local):
    owner, _, _ = owner_for(ray_local, [free(100)])
    assert owner.holders(0) == {"actor": 40 * GIB, "rollout": 40 * GIB}  # everything starts on the GPU
    owner.enter("generate")
    assert owner.holders(0) == {"rollout": 40 * GIB}


def test_out_of_memory_is_found_through_wrapped_causes():
    try:
        try:
            raise MemoryError("CUDA Error: out of memory")
        except MemoryError as inner:
            raise RuntimeError("step 5 failed") from inner
    except RuntimeError as outer:
        assert is_out_of_memory(outer)
    assert not is_out_of_memory(RuntimeError("NCCL timeout"))
