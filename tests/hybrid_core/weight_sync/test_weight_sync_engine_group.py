"""A tensor-parallel engine colocated with several trainer ranks: those ranks hand each bucket over together.

Real processes in a real gloo group (shared-memory buckets on CPU, the CUDA-IPC path's stand-in); the engine reads
each bucket list late, so a rank that reused its buffer too early would corrupt what the engine reads.
"""

import queue
import socket

import pytest
import torch.multiprocessing as mp
from sync_workers import engine_group_member, random_weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20])  # many buckets (and an oversize tensor); one bucket
def test_every_ranks_weights_reach_the_engine_intact(bucket_bytes):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world = 2
    port = _free_port()
    procs = [
        ctx.Process(target=engine_group_member, args=(r, world, port, bucket_bytes, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=120) for _ in range(world)]
    except queue.Empty:
        pytest.fail("a rank of the engine group hung")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [g for g in got if g[0] == "error"]
    assert not errors, errors
    ((_, ok, lists, sent),) = [g for g in got if g[0] == "leader"]
    names = [n for n, _ in random_weights()]
    assert ok == {peer: names for peer in range(world)}  # each rank's own tensors, bit-exact, from its own buffer
    assert lists and set(lists) == {world}  # every engine call carried one bucket per rank
    assert [g[2] for g in got if g[0] == "follower"] == [sent]


def test_a_rank_outside_the_engine_is_refused():
    import torch.distributed as dist

    from hybrid_core.weight_sync import engine_group_callbacks

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="not among the engine's ranks"):
            engine_group_callbacks([1, 2], lambda b: b, lambda r: None)
    finally:
        dist.destroy_process_group()
