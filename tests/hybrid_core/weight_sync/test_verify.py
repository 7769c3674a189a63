"""Weight-sync verification (issue 34 section 4): the checksum itself, then sender and receiver over a real gloo
group (this thread sends, a worker thread receives) and over shared-memory IPC buckets, with a bucket corrupted in
flight by the ``HYBRID_FAULT=receiver:bucket:corrupt`` fault, and a stale load the read-back catches."""

from __future__ import annotations

import random
import re
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hybrid_core import faults
from hybrid_core.errors import RoleFailure, WeightSyncMismatch
from hybrid_core.weight_sync import (
    IpcBucketSender,
    TensorMeta,
    WeightReceiver,
    WeightSender,
    checksum,
    create_sync_group,
    load_ipc_bucket,
    plan_buckets,
)
from hybrid_core.weight_sync.verify import COLUMNS, as_mismatch, word_size
from hybrid_core.weight_sync.wire import tensor_bytes

BUCKET = 4096  # smaller than the 16 KiB embedding: it is split across buckets


def weights(seed: int = 3) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("embed.weight", torch.randn(64, 64, generator=g)),  # 16 KiB fp32, spans buckets
            ("layer.0.q.weight", torch.randn(24, 40, generator=g).to(torch.bfloat16)),
            ("layer.0.norm.weight", torch.randn(40, generator=g).to(torch.bfloat16)),
            ("layer.0.mask", torch.rand(33, generator=g) > 0.5),
            ("lm_head.weight", torch.randn(50, 64, generator=g).to(torch.bfloat16))]


def reference(t: torch.Tensor) -> int:
    """The checksum by its definition, in Python integers: sum((2k + 1) * word_k) mod 2**64, words of the element
    size, as a signed 64-bit value."""
    size = t.element_size()
    words = tensor_bytes(t).view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]).tolist()
    total = sum((2 * k + 1) * w for k, w in enumerate(words)) % (1 << 64)
    return total - (1 << 64) if total >= 1 << 63 else total


def value(t: torch.Tensor) -> int:
    return int(checksum(tensor_bytes(t), t.element_size()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 7, COLUMNS - 1, COLUMNS, 3 * COLUMNS + 5])
def test_checksum_is_its_definition(dtype, n):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 1e4).to(dtype) if dtype.is_floating_point else \
        torch.randint(-100, 100, (n,), generator=g).to(dtype) * (1 << 40 if dtype == torch.int64 else 1)
    assert value(t) == reference(t)


def test_checksum_wraps_like_the_definition():
    t = torch.full((4 * COLUMNS + 3,), 2**31 - 1, dtype=torch.int32)  # sums far beyond 2**64
    assert value(t) == reference(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_checksum_catches_every_flipped_bit_and_swapped_pair(dtype):
    t = (torch.randn(2 * COLUMNS + 9) * 100).to(dtype)
    clean = value(t)
    raw = tensor_bytes(t)
    rng = random.Random(0)
    for pos in [0, 1, raw.numel() // 2, raw.numel() - 1, *rng.sample(range(raw.numel()), 20)]:
        for bit in range(8):
            bad = raw.clone()
            bad[pos] ^= 1 << bit
            assert int(checksum(bad, t.element_size())) != clean, (pos, bit)
    for i, j in [(0, 1), (5, 6), (0, t.numel() - 1), *[tuple(rng.sample(range(t.numel()), 2)) for _ in range(30)]]:
        if torch.equal(t[i], t[j]):
            continue
        swapped = t.clone()
        swapped[i], swapped[j] = t[j], t[i]
        assert value(swapped) != clean, (i, j)


def test_swapped_values_whose_bytes_add_up_alike_are_caught():
    """0x0102 and 0x0201 have the same byte sum: a checksum over bytes would miss the swap; words of the element
    size do not."""
    t = torch.tensor([0x0102, 0x0201, 7], dtype=torch.int16)
    assert value(t) != value(t[[1, 0, 2]])


def test_word_size_falls_back_to_bytes_inside_an_element():
    meta = TensorMeta("w", "float32", (10,))
    assert word_size(meta, 0, 40) == 4 and word_size(meta, 8, 16) == 4
    assert word_size(meta, 2, 16) == 1 and word_size(meta, 0, 18) == 1


# ---- the broadcast path over gloo ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pair():
    """Rank 0 (sender) in this thread, rank 1 (receiver) in a worker thread, one gloo group for the module."""
    pool = ThreadPoolExecutor(1)
    port = free_port()
    joined = pool.submit(create_sync_group, "127.0.0.1", port, 1, 2, backend="gloo", timeout_s=30)
    sender_group = create_sync_group("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=30)
    receiver_group = joined.result(timeout=60)
    yield pool, sender_group, receiver_group
    sender_group.close()
    receiver_group.close()
    pool.shutdown()


@pytest.fixture
def no_faults(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    faults._calls.clear()
    yield monkeypatch
    faults._calls.clear()


def broadcast(pair, named, *, verify=True, stale: str | None = None):
    """One sync; the receiver loads into its own tensors (skipping ``stale``: it keeps its old value) and reads them
    back. Returns what the receiver holds, or raises what it raised."""
    pool, sender_group, receiver_group = pair
    held = {n: torch.zeros_like(t) for n, t in named}

    def load(pairs):
        for name, tensor in pairs:
            if name != stale:
                held[name].copy_(tensor)

    metas = [TensorMeta.of(n, t) for n, t in named]
    received = pool.submit(WeightReceiver(receiver_group, BUCKET).receive, metas, load, held.get)
    WeightSender(sender_group, BUCKET, verify=verify).send(named)
    received.result(timeout=60)
    return held


def test_a_clean_sync_verifies_and_arrives_exactly(pair, no_faults):
    named = weights()
    held = broadcast(pair, named)
    for name, t in named:
        assert torch.equal(held[name], t), name


@pytest.mark.parametrize("nth", [1, 5, 6])
def test_a_bucket_corrupted_in_flight_is_reported_naming_the_parameter(pair, no_faults, nth):
    """The middle byte of the nth bucket's first piece is flipped (bucket 1: the first quarter of the split
    embedding; later ones: bf16, bool and split bf16 pieces); the group stays usable for the next sync."""
    first = plan_buckets([TensorMeta.of(n, t) for n, t in weights()], BUCKET)[nth - 1].pieces[0]
    name = re.escape(first.meta.name)
    no_faults.setenv(faults.ENV, f"receiver/1:bucket:corrupt:{nth}")
    with pytest.raises(WeightSyncMismatch, match=rf"weight-sync rank 1: 1 of \d+ tensor piece\(s\) differ .*{name}"
                       r".*bucket \d+, checked in the engine's parameter"):
        broadcast(pair, weights())
    no_faults.delenv(faults.ENV)
    broadcast(pair, weights(seed=4))  # the stream was drained: the next sync goes through


def test_a_stale_load_is_caught_by_reading_the_engine_back(pair, no_faults):
    """Every byte arrived intact, but the engine kept its old norm weight: only the read-back can tell."""
    with pytest.raises(WeightSyncMismatch, match=r"layer\.0\.norm\.weight \(bucket \d+, checked in the engine's"):
        broadcast(pair, weights(), stale="layer.0.norm.weight")


def test_verification_off_lets_the_corruption_through(pair, no_faults):
    """--no_verify_weight_sync means what it says: the receiver follows the sender's handshake and checks nothing."""
    no_faults.setenv(faults.ENV, "receiver:bucket:corrupt:1")
    named = weights()
    held = broadcast(pair, named, verify=False)
    assert not torch.equal(held["embed.weight"], named[0][1])


# ---- the IPC path (CPU shared memory) --------------------------------------------------------------------------
def ipc_sync(named, *, verify=True, stale: str | None = None):
    held = {n: torch.zeros_like(t) for n, t in named}

    def load(pairs):
        for name, tensor in pairs:
            if name != stale:
                held[name].copy_(tensor)

    buckets = []
    sender = IpcBucketSender(BUCKET, device="cpu", verify=verify)
    try:
        sender.send(named, deliver=lambda b: buckets.append(b) or load_ipc_bucket(b, load, held.get),
                    wait=lambda _: None)
    finally:
        sender.close()
    return held, buckets


def test_ipc_buckets_carry_checksums_and_a_clean_sync_verifies(no_faults):
    named = weights()
    held, buckets = ipc_sync(named)
    assert all(b.checksums is not None and len(b.checksums) == len(b.entries) for b in buckets if b.entries)
    assert all(torch.equal(held[n], t) for n, t in named)
    _, unchecked = ipc_sync(named, verify=False)
    assert all(b.checksums is None for b in unchecked)


def test_an_ipc_bucket_corrupted_in_flight_or_loaded_stale_names_the_parameter(no_faults):
    no_faults.setenv(faults.ENV, "receiver:bucket:corrupt:2")
    with pytest.raises(WeightSyncMismatch, match=r"IPC receiver: 1 of 3 tensor piece\(s\) differ .*layer\.0\.q\."):
        ipc_sync(weights())  # bucket 0: the oversize embedding alone; bucket 1 starts with q
    no_faults.delenv(faults.ENV)
    with pytest.raises(WeightSyncMismatch, match=r"lm_head\.weight \(bucket \d+, checked in the engine's parameter"):
        ipc_sync(weights(), stale="lm_head.weight")


# ---- the fault spec and the error's way back ---------------------------------------------------------------------
def test_corrupt_is_a_fault_action_only_the_data_holder_acts_on(no_faults):
    assert faults.parse_faults("receiver/2:bucket:corrupt:3")[0] == faults.Fault("receiver", 2, "bucket", "corrupt", 3)
    no_faults.setenv(faults.ENV, "receiver:bucket:corrupt:2")
    faults.maybe_inject("receiver", "bucket")  # the phase hooks never act a corrupt fault out
    assert [faults.corrupt_due("receiver", "bucket", 1) for _ in range(3)] == [False, True, False]


def test_a_remote_mismatch_comes_back_as_a_mismatch():
    remote = RoleFailure("rollout engine 1: update_weights: raised hybrid_core.errors.WeightSyncMismatch: weight "
                         "sync verify: weight-sync rank 2: 1 of 9 tensor piece(s) differ: lm_head.weight")
    got = as_mismatch(remote)
    assert isinstance(got, WeightSyncMismatch) and "rollout engine 1" in str(got) and "lm_head.weight" in str(got)
    assert as_mismatch(RoleFailure("rollout engine 1: generate: raised ValueError: x")) is None
