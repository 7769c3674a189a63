"""The wake check's decision, with given numbers: room -> nothing; no room -> an error naming who holds the GPU."""

import pytest

from hybrid_core.errors import GpuMemoryError
from hybrid_core.gpu_memory import GIB, GpuMemory, check_room, probe


def test_room_enough_passes():
    check_room("actor", 0, 10 * GIB, GpuMemory(free=11 * GIB, total=80 * GIB), awake={"reference": 2 * GIB})
    check_room("actor", 0, 0, GpuMemory(free=0, total=80 * GIB), awake={})  # nothing to bring back


def test_headroom_counts():
    with pytest.raises(GpuMemoryError):
        check_room("actor", 0, 10 * GIB, GpuMemory(free=10 * GIB, total=80 * GIB), awake={}, headroom=1)


def test_shortage_names_the_awake_roles_and_the_processes():
    memory = GpuMemory(free=3 * GIB, total=80 * GIB, processes="pid 4242 (python) 70000 MiB")
    with pytest.raises(GpuMemoryError) as e:
        check_room("actor", 2, 20 * GIB, memory, awake={"actor": None, "rollout": 60 * GIB, "reference": None})
    text = str(e.value)
    assert text.startswith("actor cannot wake on GPU 2: it needs 20.00 GiB")
    assert "3.00 GiB of 80.00 GiB is free" in text
    assert "rollout (60.00 GiB)" in text and "reference" in text and "actor (" not in text
    assert "pid 4242" in text
    assert "Fix: make rollout sleep before actor's turn" in text


def test_shortage_with_no_known_holder_points_at_other_processes():
    with pytest.raises(GpuMemoryError) as e:
        check_room("rollout", 0, 8 * GIB, GpuMemory(free=GIB, total=16 * GIB), awake={})
    assert "no other hybrid role is awake on it" in str(e.value) and "free the GPU from other jobs" in str(e.value)


def test_probe_is_none_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine gives a real reading; the GPU wake-guard run (bench/wake_guard_gpu.py) covers it")
    assert probe() is None


def test_a_role_too_small_to_matter_is_not_the_fix():
    # seen on an H200: a foreign process held 136 GiB; sleeping the actor (a few MiB) would not have helped
    memory = GpuMemory(free=GIB // 4, total=140 * GIB, processes="process 4033 uses 139798 MB")
    with pytest.raises(GpuMemoryError) as e:
        check_room("rollout", 0, GIB, memory, awake={"actor": 1 << 20, "reference": None})
    assert "free the GPU from other jobs" in str(e.value) and "make actor sleep" not in str(e.value)
