"""The broadcast path with real processes over gloo: one sender, two receivers, mixed dtypes, bucket sizes down to
smaller than the largest tensor; every tensor must arrive bit-exactly at both receivers."""

import socket

import torch.multiprocessing as mp
from sync_workers import BUCKET_SIZES, gloo_member, random_weights

from hybrid_core.weight_sync import TensorMeta, plan_buckets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_random_weights_reach_two_receivers_bit_exactly_for_every_bucket_size():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=gloo_member, args=(rank, 3, port, results), daemon=True) for rank in range(3)]
    for p in procs:
        p.start()
    try:
        messages = [results.get(timeout=240) for _ in range(3 * len(BUCKET_SIZES))]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [m for m in messages if m[0] == "error"]
    assert not errors, errors
    names = [n for n, _ in random_weights()]
    metas = [TensorMeta.of(n, t) for n, t in random_weights()]
    payload = sum(t.numel() * t.element_size() for _, t in random_weights())
    received = [m for m in messages if m[0] == "received"]
    assert sorted((m[1], m[2]) for m in received) == sorted((r, b) for r in (1, 2) for b in BUCKET_SIZES)
    for _, rank, bucket_bytes, nbytes, exact, n_loads in received:
        assert exact == names, (rank, bucket_bytes)
        assert nbytes == payload
        # load() runs once per bucket that completes a tensor (a spanning tensor completes in its last bucket)
        plan = plan_buckets(metas, bucket_bytes)
        assert n_loads == sum(any(p.completes for p in b.pieces) for b in plan)
        if bucket_bytes == 1024:
            assert len(plan) > 17  # the 16 KiB tensor alone spans 17 buckets
    sent = [m for m in messages if m[0] == "sent"]
    assert [m[3] for m in sent] == [payload] * len(BUCKET_SIZES)
