"""The colocated path: buckets handed over by handle (CUDA IPC on GPU; shared-memory files on CPU, tested here).

Bit-exact delivery for several bucket sizes (one smaller than the largest tensor, which then travels alone), at most
two buckets in flight, buffers reused across sends, and shared files removed on close.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp
from sync_workers import BUCKET_SIZES, ipc_engine, random_weights

from hybrid_core.errors import ConfigError
from hybrid_core.weight_sync import IpcBucketSender, load_ipc_bucket
from hybrid_core.weight_sync import ipc as ipc_module


@pytest.mark.parametrize("bucket_bytes", BUCKET_SIZES)
def test_buckets_open_bit_exactly_with_two_in_flight_at_most(bucket_bytes):
    sender = IpcBucketSender(bucket_bytes=bucket_bytes, device="cpu")
    got, inflight, max_inflight, indices, mapped = {}, set(), [0], [], []

    def load(pairs):
        got.update({name: tensor.clone() for name, tensor in pairs})

    def deliver(bucket):
        load_ipc_bucket(bucket, load)  # the receiver side, here in-process (shm maps anywhere)
        mapped.append(len(ipc_module._MAPPED))
        inflight.add(bucket.index)
        indices.append((bucket.index, bucket.last))
        max_inflight[0] = max(max_inflight[0], len(inflight))
        return bucket.index

    stats = sender.send(iter(random_weights()), deliver, inflight.discard)
    expected = random_weights()
    assert [n for n, t in expected if got[n].dtype == t.dtype and torch.equal(got[n], t)] == [n for n, _ in expected]
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in expected)
    assert max_inflight[0] <= 2 and not inflight and indices == sorted(indices)
    # only the final delivery says "last"; the receiver keeps <= 2 buffers mapped and unmaps them all at the end
    assert [last for _, last in indices] == [False] * (len(indices) - 1) + [True]
    assert max(mapped) <= 2 and mapped[-1] == 0
    paths = [slot.path for slot in sender._slots]
    assert all(os.path.exists(p) for p in paths)
    sender.send(iter(random_weights(seed=8)), deliver, inflight.discard)  # buffers are reused
    assert [slot.path for slot in sender._slots] == paths
    assert torch.equal(got["embed.weight"], dict(random_weights(seed=8))["embed.weight"])
    sender.close()
    assert not any(os.path.exists(p) for p in paths)


def test_another_process_receives_bit_exactly():
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=ipc_engine, args=(requests, replies), daemon=True)
    engine.start()
    acked: set[int] = set()

    def deliver(bucket):
        requests.put(bucket)
        return bucket.index

    def wait(index):
        while index not in acked:
            kind, value = replies.get(timeout=120)
            assert kind == "ack", value
            acked.add(value)

    sender = IpcBucketSender(bucket_bytes=4096, device="cpu")
    try:
        sender.send(iter(random_weights()), deliver, wait)
        requests.put(None)
        kind, exact = replies.get(timeout=60)
    finally:
        sender.close()
        engine.join(timeout=30)
        if engine.is_alive():
            engine.kill()
    assert kind == "done", exact
    assert exact == [n for n, _ in random_weights()]


def test_bad_bucket_size_and_device_name_the_field():
    with pytest.raises(ConfigError) as e:
        IpcBucketSender(bucket_bytes=10, device="cpu")
    assert e.value.field == "bucket_bytes"
    with pytest.raises(ConfigError) as e:
        IpcBucketSender(bucket_bytes=4096, device="meta")
    assert e.value.field == "device"
