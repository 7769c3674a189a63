"""The wake guard around a real colocated plan, with scripted GPU readings (this machine has no CUDA to read).

Two ways a wake meets a full GPU: the check sees it first (the guard's error before any wake is tried), or another
process takes the memory between the check and the wake (seen on an H200 with a process grabbing what a sleep
freed): the wake's own out-of-memory error then becomes the guard's error, naming the processes on the GPU.
"""

from types import SimpleNamespace

import pytest

from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.memory_guard import WakeGuard
from hybrid_algos.train.placement import build_plan
from hybrid_algos.train.step import guarded_wake, turn
from hybrid_core.errors import GpuMemoryError
from hybrid_core.gpu_memory import GIB, GpuMemory, is_out_of_memory
from hybrid_core.stats import PhaseTimer

HOG = "pid 16484 (python) 136000 MiB"


class ScriptedGuard(WakeGuard):
    """A WakeGuard whose GPU readings come from a list (each read takes the next one; the last one repeats)."""

    def __init__(self, plan, readings):
        super().__init__(plan, [])
        self.readings = list(readings)

    def read(self, gpu):
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def free(gib, processes=None):
    return GpuMemory(free=int(gib * GIB), total=140 * GIB, processes=processes)


def context(guard):
    return SimpleNamespace(memory=guard, turnstile=None, config=SimpleNamespace(call_timeout_s=5))


@pytest.fixture
def plan():
    return build_plan(GRPOConfig().validate())  # the demo: everything on GPU 0, rollout and actor sleeping


def test_the_check_stops_a_wake_before_it_is_tried(plan):
    guard = ScriptedGuard(plan, [free(100), free(60), free(2, HOG)])
    guarded_wake(context(guard), "rollout", "kv_cache", lambda: None)  # first wake: measured, 40 GiB
    assert guard.woke[("rollout", "kv_cache")] == {0: 40 * GIB}
    tried = []
    with pytest.raises(GpuMemoryError) as e:
        guarded_wake(context(guard), "rollout", "kv_cache", lambda: tried.append(1))
    assert not tried
    assert "rollout cannot wake on GPU 0: it needs 40.00 GiB" in str(e.value) and "16484" in str(e.value)


def test_memory_taken_after_the_check_gives_the_guards_error_not_the_oom(plan):
    guard = ScriptedGuard(plan, [free(100), free(60), free(100), free(0.25, HOG)])
    guarded_wake(context(guard), "rollout", "kv_cache", lambda: None)

    def wake():  # what vLLM's allocator raises when the memory went between the reading and the wake
        raise RuntimeError("rollout engine 0: wake_up: raised RuntimeError: CUDA Error: out of memory at cumem.cpp:163")

    with pytest.raises(GpuMemoryError) as e:
        guarded_wake(context(guard), "rollout", "kv_cache", wake)
    text = str(e.value)
    assert text.startswith("rollout cannot wake on GPU 0: it needs 40.00 GiB")
    assert "0.25 GiB of 140.00 GiB is free" in text and "processes on the GPU: pid 16484" in text
    assert "the wake ran out of memory (rollout engine 0: wake_up: raised RuntimeError: CUDA Error" in text
    assert isinstance(e.value.__cause__, RuntimeError)  # the original stays attached for the traceback


def test_other_wake_failures_pass_through_unchanged(plan):
    guard = ScriptedGuard(plan, [free(100)])

    def wake():
        raise TimeoutError("rollout engine 0: wake_up did not answer within 5 s")

    with pytest.raises(TimeoutError):
        guarded_wake(context(guard), "rollout", "kv_cache", wake)


def test_a_turn_explains_its_wake_and_gives_the_turn_back(plan):
    released = []
    turnstile = SimpleNamespace(acquire=lambda *a, **k: None, release=lambda role, gpus: released.append(role))
    guard = ScriptedGuard(plan, [free(100), free(0.1, HOG)])
    ctx = SimpleNamespace(memory=guard, turnstile=turnstile, config=SimpleNamespace(call_timeout_s=5))

    def wake():
        raise RuntimeError("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(GpuMemoryError, match="actor cannot wake on GPU 0: it needs more memory"):
        with turn(ctx, "actor", [0], True, PhaseTimer(), wake, lambda: None):
            pytest.fail("the block must not run when the wake failed")
    assert released == ["actor"]


def test_out_of_memory_is_found_through_wrapped_causes():
    try:
        try:
            raise MemoryError("CUDA Error: out of memory")
        except MemoryError as inner:
            raise RuntimeError("step 5 failed") from inner
    except RuntimeError as outer:
        assert is_out_of_memory(outer)
    assert not is_out_of_memory(RuntimeError("NCCL timeout"))
