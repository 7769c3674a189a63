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
    checksum_path,
    create_sync_group,
    load_ipc_bucket,
    plan_buckets,
    verify,
)
from hybrid_core.weight_sync.sampling import PERIOD, Rotation, VerifyPolicy
from hybrid_core.weight_sync.verify import ROW, SMALL, as_mismatch, word_size
from hybrid_core.weight_sync.wire import tensor_bytes

BUCKET = 4096  # smaller than the 16 KiB embedding: it is split across buckets


def weights(seed: int = 3) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(64, 64, generator=g)),  # 16 KiB fp32, spans buckets
        ("layer.0.q.weight", torch.randn(24, 40, generator=g).to(torch.bfloat16)),
        ("layer.0.norm.weight", torch.randn(40, generator=g).to(torch.bfloat16)),
        ("layer.0.mask", torch.rand(33, generator=g) > 0.5),
        ("lm_head.weight", torch.randn(50, 64, generator=g).to(torch.bfloat16)),
    ]


def reference(t: torch.Tensor) -> int:
    """The checksum by its definition, in Python integers: sum over bytes b_p (signed int8) of
    (2 * (p // s) + 1) * 256**(p % s) * b_p mod 2**64, s the element size, as a signed 64-bit value."""
    return definition(tensor_bytes(t), t.element_size())


def definition(raw: torch.Tensor, s: int) -> int:
    total = sum((2 * (p // s) + 1) * 256 ** (p % s) * b for p, b in enumerate(raw.view(torch.int8).tolist()))
    total %= 1 << 64
    return total - (1 << 64) if total >= 1 << 63 else total


def value(t: torch.Tensor) -> int:
    return int(checksum(tensor_bytes(t), t.element_size()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 7, ROW // 2 - 1, ROW, 3 * ROW + 5, SMALL // 8 + 3])
def test_checksum_is_its_definition(dtype, n):
    """Small pieces and tails (the direct sum over a cached G); the matrix path below."""
    g = torch.Generator().manual_seed(n)
    t = (
        (torch.randn(n, generator=g) * 1e4).to(dtype)
        if dtype.is_floating_point
        else torch.randint(-100, 100, (n,), generator=g).to(dtype) * (1 << 40 if dtype == torch.int64 else 1)
    )
    assert value(t) == reference(t)


@pytest.mark.parametrize("s", [1, 2, 4, 8])
@pytest.mark.parametrize("nbytes", [SMALL, SMALL + 8, 40 * ROW + 3 * 1024 + 8])
def test_every_path_gives_the_definitions_value(s, nbytes):
    """torch._int_mm, the reductions that stand in for it, and Python integers agree (rows, a tail, every word
    size), so a sender on one path and a receiver on the other agree too."""
    raw = torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(nbytes + s), dtype=torch.uint8)
    want = definition(raw, s)
    rows = nbytes // ROW
    block = raw.view(torch.int8)[: rows * ROW].view(rows, ROW)
    tail = int(verify._direct(raw.view(torch.int8)[rows * ROW :], s, rows * ROW)) if nbytes % ROW else 0
    for path in ("int_mm", "reduce"):
        if path == "int_mm" and checksum_path("cpu") != "int_mm":
            continue  # this CPU build has no working torch._int_mm: its self-test said so
        m = verify._M_PATHS[path](block, s)
        assert verify._wrap(verify._combine(m, s) + tail) == want, path
    assert int(checksum(raw, s)) == want


def test_a_failing_fast_path_falls_back_and_still_checks(monkeypatch):
    """An exception in torch._int_mm never skips a check: the reductions give the same value."""
    raw = torch.randint(0, 256, (SMALL + ROW,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    want = int(checksum(raw, 2))
    monkeypatch.setitem(verify._PATH, torch.device("cpu"), "int_mm")

    def broken(*_):
        raise RuntimeError("simulated cuBLAS refusal")

    monkeypatch.setitem(verify._M_PATHS, "int_mm", broken)
    assert int(checksum(raw, 2)) == want
    assert checksum_path("cpu") == "reduce"


def test_checksum_wraps_like_the_definition():
    t = torch.full((SMALL // 4 + 3,), 2**31 - 1, dtype=torch.int32)  # sums far beyond 2**64
    assert value(t) == reference(t)


def weights_g(n: int, s: int) -> list[int]:
    """G(p) mod 2**64 for p < n: the definition's position weights (the implementation is the definition: the tests
    above), for the proofs' arithmetic over every position and pair."""
    return [(2 * (p // s) + 1) * 256 ** (p % s) % (1 << 64) for p in range(n)]


@pytest.mark.parametrize("s", [1, 2, 4])
def test_every_changed_byte_is_caught_at_every_position(s):
    """Exhaustive over a 2 KiB piece: each position, changed by +1, -1, +128 (the sign bit) and to its complement;
    and, by the proof, every change d * G(p) != 0 mod 2**64 for |d| < 256 (G(p)'s factors of two, below)."""
    raw = torch.randint(0, 256, (2048,), generator=torch.Generator().manual_seed(s), dtype=torch.uint8)
    clean = int(checksum(raw, s))
    for pos in range(raw.numel()):
        for new in {
            (int(raw[pos]) + 1) % 256,
            (int(raw[pos]) - 1) % 256,
            (int(raw[pos]) + 128) % 256,
            255 - int(raw[pos]),
        }:
            bad = raw.clone()
            bad[pos] = new
            assert int(checksum(bad, s)) != clean, (pos, new)
    for p, g in enumerate(weights_g(2048, s)):
        assert g and _twos(g) + 7 < 64, p  # any |d| < 256 has at most 7 factors of two


@pytest.mark.parametrize("s", [1, 2, 4])
def test_every_swap_of_two_unequal_bytes_is_caught(s):
    """Exhaustive over a 2 KiB piece: every pair of positions p < q (2 million): the swap changes the checksum by
    (b_q - b_p) * (G(p) - G(q)), never 0 mod 2**64 since G(p) - G(q) has at most 56 factors of two and a byte
    difference at most 7; a sample of the swaps recomputed outright."""
    n = 2048
    g = weights_g(n, s)
    for p in range(n):
        gp = g[p]
        for q in range(p + 1, n):
            assert _twos((gp - g[q]) % (1 << 64)) + 7 < 64, (p, q)
    raw = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(7), dtype=torch.uint8)
    clean = int(checksum(raw, s))
    rng = random.Random(s)
    for p, q in [(0, 1), (0, n - 1), (1, 1 + s), *[tuple(rng.sample(range(n), 2)) for _ in range(300)]]:
        if raw[p] == raw[q]:
            continue
        bad = raw.clone()
        bad[p], bad[q] = raw[q], raw[p]
        assert int(checksum(bad, s)) != clean, (p, q)


def _twos(v: int) -> int:
    """Factors of two of a nonzero integer mod 2**64 (64 for 0)."""
    return (v & -v).bit_length() - 1 if v else 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_checksum_catches_every_flipped_bit_and_swapped_pair(dtype):
    t = (torch.randn(SMALL // dtype.itemsize + 9) * 100).to(dtype)  # the matrix path plus a tail
    clean = value(t)
    raw = tensor_bytes(t)
    rng = random.Random(0)
    for pos in [0, 1, raw.numel() // 2, raw.numel() - 1, *rng.sample(range(raw.numel()), 2)]:
        for bit in range(8):
            bad = raw.clone()
            bad[pos] ^= 1 << bit
            assert int(checksum(bad, t.element_size())) != clean, (pos, bit)
    for i, j in [(0, 1), (5, 6), (0, t.numel() - 1), *[tuple(rng.sample(range(t.numel()), 2)) for _ in range(5)]]:
        if torch.equal(t[i], t[j]):
            continue
        swapped = t.clone()
        swapped[i], swapped[j] = t[j], t[i]
        assert value(swapped) != clean, (i, j)


def test_swapped_values_whose_bytes_add_up_alike_are_caught():
    """0x0102 and 0x0201 have the same byte sum: a checksum with one weight per byte position pattern could miss the
    swap; words of the element size do not."""
    t = torch.tensor([0x0102, 0x0201, 7], dtype=torch.int16)
    assert value(t) != value(t[[1, 0, 2]])
    big = torch.tensor([0x0102, 0x0201] * (SMALL // 4), dtype=torch.int16)  # the same on the matrix path
    assert value(big) != value(big[torch.tensor([1, 0, *list(range(2, big.numel()))])])


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
    with pytest.raises(
        WeightSyncMismatch,
        match=rf"weight-sync rank 1: 1 of \d+ tensor piece\(s\) differ .*{name}"
        r".*bucket \d+, checked in the engine's parameter",
    ):
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
        sender.send(
            named, deliver=lambda b: buckets.append(b) or load_ipc_bucket(b, load, held.get), wait=lambda _: None
        )
    finally:
        sender.close()
    return held, buckets


def sent_sums(buckets) -> dict[int, tuple[int, ...]]:
    """The sender's checksums by bucket index, whichever bucket carried them."""
    return {index: sums for b in buckets for index, sums in b.sums}


def test_ipc_buckets_carry_checksums_and_a_clean_sync_verifies(no_faults):
    named = weights()
    held, buckets = ipc_sync(named)
    assert all(b.checked is not None and all(b.checked) for b in buckets if b.entries)
    sums = sent_sums(buckets)  # every checked bucket's checksums arrive, one per checked entry ...
    assert {b.index: len(b.entries) for b in buckets if b.entries} == {i: len(v) for i, v in sums.items()}
    for b in buckets:  # ... with the bucket itself where nothing follows it, else with the next one
        if b.entries:
            carrier = b if (b.last or not b.reusable) else next(c for c in buckets if c.index == b.index + 1)
            assert b.index in dict(carrier.sums)
    assert len({b.sync for b in buckets}) == 1
    assert all(torch.equal(held[n], t) for n, t in named)
    _, unchecked = ipc_sync(named, verify=False)
    assert all(b.checked is None and not b.sums for b in unchecked)


@pytest.mark.parametrize("corrupt_first_loaded", [False, True])
def test_an_engine_taking_the_buckets_out_of_order_still_checks_the_whole_sync(no_faults, corrupt_first_loaded):
    """An engine serving calls concurrently (max_concurrency > 1) may load a sync's buckets in any order: the
    comparison waits until every bucket is in, and a corruption in the bucket loaded first is still named."""
    named = weights()
    held = {n: torch.zeros_like(t) for n, t in named}

    def load(pairs):
        for name, tensor in pairs:
            held[name].copy_(tensor)

    buckets = []
    sender = IpcBucketSender(20000, device="cpu")  # two buckets, no buffer reused: [embed, q, norm, mask], [lm_head]
    try:
        sender.send(named, deliver=buckets.append, wait=lambda _: None)
        assert [b.index for b in buckets] == [0, 1] and buckets[1].last
        if corrupt_first_loaded:
            no_faults.setenv(faults.ENV, "receiver:bucket:corrupt:1")
        load_ipc_bucket(buckets[1], load, held.get)  # the last bucket first: nothing compared yet
        if corrupt_first_loaded:
            with pytest.raises(WeightSyncMismatch, match=r"lm_head\.weight \(bucket 1"):
                load_ipc_bucket(buckets[0], load, held.get)
        else:
            load_ipc_bucket(buckets[0], load, held.get)
            assert all(torch.equal(held[n], t) for n, t in named)
    finally:
        sender.close()


def test_late_checksums_are_the_sending_buckets_and_a_missing_one_is_refused(no_faults):
    """The checksums a later bucket carries are the earlier bucket's own (recomputed here from the tensors), and a
    receiver that never gets a checked bucket's checksums fails the sync instead of passing it unchecked."""
    from dataclasses import replace

    from hybrid_core.weight_sync.verify import tensors_checksums

    named = weights()
    _, buckets = ipc_sync(named)
    tensors = dict(named)
    for b in buckets:
        if b.entries:
            mine = [tensor_bytes(tensors[m.name]) for m, _ in b.entries]
            sizes = [t.element_size() for t in (tensors[m.name] for m, _ in b.entries)]
            assert sent_sums(buckets)[b.index] == tuple(tensors_checksums(mine, sizes).tolist())
    held = {n: torch.zeros_like(t) for n, t in named}

    def load(pairs):
        for name, tensor in pairs:
            held[name].copy_(tensor)

    late = next(b for b in buckets if b.sums and b.sums[0][0] != b.index)  # carries another bucket's checksums
    sender = IpcBucketSender(BUCKET, device="cpu")
    try:
        with pytest.raises(WeightSyncMismatch, match=r"checksums on one side only"):
            sender.send(
                named,
                deliver=lambda b: load_ipc_bucket(replace(b, sums=()) if b.index == late.index else b, load, held.get),
                wait=lambda _: None,
            )
    finally:
        sender.close()


def test_an_ipc_bucket_corrupted_in_flight_or_loaded_stale_names_the_parameter(no_faults):
    no_faults.setenv(faults.ENV, "receiver:bucket:corrupt:2")
    with pytest.raises(WeightSyncMismatch, match=r"IPC receiver: 1 of \d+ tensor piece\(s\) differ .*layer\.0\.q\."):
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
    remote = RoleFailure(
        "rollout engine 1: update_weights: raised hybrid_core.errors.WeightSyncMismatch: weight "
        "sync verify: weight-sync rank 2: 1 of 9 tensor piece(s) differ: lm_head.weight"
    )
    got = as_mismatch(remote)
    assert isinstance(got, WeightSyncMismatch) and "rollout engine 1" in str(got) and "lm_head.weight" in str(got)
    assert as_mismatch(RoleFailure("rollout engine 1: generate: raised ValueError: x")) is None


# ---- which pieces a sync checks (sampling.py) ----------------------------------------------------------------------
def llama_sizes() -> list[int]:
    """The 1B Llama of the bench in bf16: embedding, 16 x (4 attention, 3 MLP, 2 norms), norm, head."""
    h, ffn, vocab = 2048 * 2, 5632 * 2, 32000
    layer = [h * 2048] * 4 + [ffn * 2048] * 3 + [h, h]
    return [vocab * h] + layer * 16 + [h, vocab * h]


def test_sampled_mode_checks_every_piece_within_the_period_and_all_in_the_first_sync():
    sizes = llama_sizes()

    def chosen(policy):
        rotation = Rotation(policy)
        return {i for i, n in enumerate(sizes) if rotation.take(n)}

    everything = set(range(len(sizes)))
    assert chosen(VerifyPolicy("sampled", 0)) == everything  # a run's (or a resumed run's) first sync
    assert chosen(VerifyPolicy("full", 7)) == everything and chosen(VerifyPolicy("off", 0)) == set()
    seen: list[set[int]] = [chosen(VerifyPolicy("sampled", n)) for n in range(1, PERIOD + 1)]
    assert set().union(*seen) == everything  # every piece within PERIOD syncs ...
    assert sum(len(x) for x in seen) == len(sizes)  # ... exactly once per rotation
    assert chosen(VerifyPolicy("sampled", PERIOD + 1)) == seen[0]  # the same groups every rotation
    biggest, share = max(sizes), sum(sizes) / PERIOD
    assert all(sum(sizes[i] for i in x) <= share + biggest for x in seen)  # balanced: 1/PERIOD + one piece
    assert max(len(x) for x in seen) <= 2 * len(sizes) / PERIOD + 2  # and few pieces per sync
    assert all(x == set(range(min(x), max(x) + 1)) for x in seen if x)  # neighbours: one or two buckets a sync
    changed = [*sizes[:10], 12345, *sizes[10:]]  # another stream: balanced afresh, still complete
    rotations = [Rotation(VerifyPolicy("sampled", n)) for n in range(1, PERIOD + 1)]
    assert set().union(*[{i for i, n in enumerate(changed) if r.take(n)} for r in rotations]) == set(
        range(len(changed))
    )


def test_a_sampled_sync_checks_only_its_pieces_and_the_first_one_checks_all(pair, no_faults):
    """Broadcast path: a fresh sender in mode "sampled" checks every piece of its first send (a corrupted bucket is
    caught); a later sync catches it only when it samples the corrupted piece -- what the docs say."""
    named = weights()
    metas = [TensorMeta.of(n, t) for n, t in named]
    first = plan_buckets(metas, BUCKET)[0].pieces[0]  # the fault corrupts bucket 1's first piece
    no_faults.setenv(faults.ENV, "receiver/1:bucket:corrupt:1")
    with pytest.raises(WeightSyncMismatch, match=re.escape(first.meta.name)):
        broadcast(pair, named, verify="sampled")
    pieces = [p for b in plan_buckets(metas, BUCKET) for p in b.pieces]
    syncs = {}
    for n in range(1, PERIOD + 1):
        rotation = Rotation(VerifyPolicy("sampled", n, PERIOD))
        syncs[n] = [p for p in pieces if rotation.take(p.nbytes)]
    hit = next(n for n, ps in syncs.items() if first in ps)
    miss = next(n for n, ps in syncs.items() if first not in ps)
    no_faults.setenv(faults.ENV, "receiver/1:bucket:corrupt:1")
    faults._calls.clear()
    with pytest.raises(WeightSyncMismatch, match=re.escape(first.meta.name)):
        broadcast(pair, named, verify=VerifyPolicy("sampled", hit))
    faults._calls.clear()
    held = broadcast(pair, named, verify=VerifyPolicy("sampled", miss))  # not sampled: it goes through
    assert not torch.equal(held["embed.weight"], named[0][1])


def test_ipc_buckets_in_sampled_mode_carry_only_the_sampled_checksums(no_faults):
    named = weights()
    _, first = ipc_sync(named, verify=VerifyPolicy("sampled", 0))
    assert all(b.checked is not None and all(b.checked) for b in first if b.entries)
    counts = []
    for n in range(1, PERIOD + 1):
        _, later = ipc_sync(named, verify=VerifyPolicy("sampled", n))
        marked = sum(sum(b.checked) for b in later if b.checked)
        assert marked == sum(len(v) for v in sent_sums(later).values())  # a checksum per mark, no more
        counts.append(marked)
    assert sum(counts) == len(named)  # each tensor exactly once per rotation
    no_faults.setenv(faults.ENV, "receiver:bucket:corrupt:2")
    with pytest.raises(WeightSyncMismatch, match=r"layer\.0\.q\."):
        ipc_sync(weights(), verify="sampled")  # a fresh sender's first sync checks all
