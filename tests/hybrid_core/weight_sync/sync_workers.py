"""Process bodies for the weight-sync tests (spawned with torch.multiprocessing; importable by module name)."""

from __future__ import annotations

import torch

BUCKET_SIZES = (1024, 4096, 64 << 10, 1 << 20)  # 1 KiB and 4 KiB are smaller than the largest tensor (16 KiB)


def random_weights(seed: int = 7) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and shapes, the same in every process for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("layer.0.q.weight", torch.randn(24, 40, generator=g).to(torch.bfloat16)),
        ("layer.0.norm.weight", torch.randn(40, generator=g).to(torch.bfloat16)),
        ("embed.weight", torch.randn(64, 64, generator=g)),  # 16 KiB fp32: spans small buckets
        ("layer.0.scale", torch.randn((), generator=g)),
        ("layer.0.mask", torch.rand(33, generator=g) > 0.5),
        ("layer.0.positions", torch.randint(-(2**40), 2**40, (17,), generator=g)),
        ("layer.0.empty", torch.zeros(0, 5)),
        ("lm_head.weight", torch.randn(50, 64, generator=g).to(torch.bfloat16)),
        ("final.half", torch.randn(3, 7, generator=g).to(torch.float16)),
    ]


def gloo_member(rank: int, world_size: int, port: int, results) -> None:
    """Rank 0 sends the weights once per bucket size (lazily); other ranks receive and check them bit-exactly."""
    from hybrid_core.weight_sync import TensorMeta, WeightReceiver, WeightSender, create_sync_group

    try:
        group = create_sync_group("127.0.0.1", port, rank, world_size, backend="gloo", timeout_s=60)
        expected = random_weights()
        metas = [TensorMeta.of(n, t) for n, t in expected]
        for bucket_bytes in BUCKET_SIZES:
            if rank == 0:
                stats = WeightSender(group, bucket_bytes).send((n, t) for n, t in random_weights())
                results.put(("sent", rank, bucket_bytes, stats.bytes))
                continue
            got: dict[str, torch.Tensor] = {}
            loads = []

            def load(pairs, loads=loads, got=got):  # this bucket size's lists (bound now, not at call time)
                loads.append([n for n, _ in pairs])
                for name, tensor in pairs:
                    got[name] = tensor.clone()  # the bucket buffer is reused: copy before returning

            stats = WeightReceiver(group, bucket_bytes).receive(metas, load)
            exact = [n for n, t in expected if n in got and got[n].dtype == t.dtype and torch.equal(got[n], t)]
            results.put(("received", rank, bucket_bytes, stats.bytes, exact, len(loads)))
        group.close()
    except BaseException as e:  # report instead of dying silently
        results.put(("error", rank, repr(e)))


def ipc_engine(requests, replies) -> None:
    """Receives IpcBuckets, loads them by copying, acknowledges each; finally reports what it holds."""
    from hybrid_core.weight_sync import load_ipc_bucket

    got: dict[str, torch.Tensor] = {}
    try:
        while (bucket := requests.get(timeout=60)) is not None:

            def load(pairs):
                for name, tensor in pairs:
                    got[name] = tensor.clone()

            load_ipc_bucket(bucket, load)
            replies.put(("ack", bucket.index))
        expected = random_weights()
        exact = [n for n, t in expected if n in got and got[n].dtype == t.dtype and torch.equal(got[n], t)]
        replies.put(("done", exact))
    except BaseException as e:
        replies.put(("error", repr(e)))


def engine_group_member(rank: int, world_size: int, port: int, bucket_bytes: int, results) -> None:
    """Trainer ranks 0..world-1 share one "TP engine": each packs its own weights (seed = its rank); rank 0 submits
    each bucket list and the engine reads it only later, in ``wait_submitted`` (as a busy engine would), after a
    pause; every rank's tensors must still arrive intact (no buffer reused before the engine is done)."""
    import time

    import torch.distributed as dist

    from hybrid_core.weight_sync import IpcBucketSender, engine_group_callbacks, load_ipc_bucket

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        got: dict[tuple[int, str], torch.Tensor] = {}
        lists: list[int] = []

        def submit(buckets):
            lists.append(len(buckets))
            return buckets

        def wait_submitted(buckets):
            time.sleep(0.05)  # the engine comes to the buckets late: followers must still be waiting
            for peer, bucket in enumerate(buckets):
                load_ipc_bucket(bucket, lambda pairs, p=peer: got.update({(p, n): t.clone() for n, t in pairs}))

        deliver, wait = engine_group_callbacks(list(range(world_size)), submit, wait_submitted)
        sender = IpcBucketSender(bucket_bytes=bucket_bytes, device="cpu")
        for seed_offset in (0, 100):  # two syncs: the buffers are reused
            stats = sender.send(iter(random_weights(seed=rank + seed_offset)), deliver, wait)
        sender.close()
        if rank == 0:
            ok = {
                peer: [n for n, t in random_weights(seed=peer + 100) if torch.equal(got[(peer, n)], t)]
                for peer in range(world_size)
            }
            results.put(("leader", ok, lists, stats.bytes))
        else:
            results.put(("follower", rank, stats.bytes))
        dist.destroy_process_group()
    except Exception as e:  # report instead of hanging the test
        import traceback

        results.put(("error", rank, f"{e!r}\n{traceback.format_exc()}"))
