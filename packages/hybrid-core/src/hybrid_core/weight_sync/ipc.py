"""Colocated weight sync: sender and engine share a GPU, so buckets are handed over by CUDA IPC handle, not copied.

The sender packs flat buckets in its own device memory and sends only a small :class:`IpcBucket` (an IPC handle of
the bucket buffer + the tensors' metadata and offsets) to the engine, e.g. through a Ray call; the engine maps the
buffer and copies the tensors into its model. Two buffers alternate so packing the next bucket overlaps the engine's
loading of the previous one; a buffer is reused only after the engine said it is done with it.

On CPU the same code path runs over shared-memory files (``/dev/shm``), so it is tested without a GPU.
A tensor larger than a bucket travels alone in a temporary buffer of its own size.

A tensor-parallel engine spans several GPUs, each shared with one trainer rank: :func:`engine_group_callbacks` makes
those ranks hand over each bucket together (one bucket per GPU in a single engine call; each engine worker maps the
one on its own GPU). One NCCL group holding a trainer rank and an engine worker on the same GPU is not an option:
NCCL refuses two ranks on one device ("Duplicate GPU detected"), seen with vLLM TP 2 on two H200s.

Verification (``verify``, the default: ``sampled``, see ``sampling.py``): a bucket says which of its tensors this sync
checks; their checksums (``verify.py``) are computed on the sender's device *after* the hand-over, while the engine
loads the bucket, and travel with the next bucket (the sync's last bucket, and a tensor travelling alone, carry
their own). The receiver computes its side after each load, over the engine's tensors where ``read_back`` gives them
(launched after the load, not waited for), and compares everything once, at the sync's last bucket, raising
:class:`~hybrid_core.errors.WeightSyncMismatch` naming the parameter before it acknowledges it. So a check waits
for nothing in the middle of a sync: on one GPU a checked bucket used to hold both sides for their kernels and host
reads (4.6 % of a 1B sync's time on an H200 for 1/32 of the bytes, most of it waiting, not checksumming).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import faults
from ..errors import ConfigError, WeightSyncMismatch
from ..stats import TransferStats
from .buckets import BucketPacker, Piece, check_bucket_bytes
from .meta import TensorMeta
from .sampling import Rotation, VerifyPolicy, as_policy
from .sender import DEFAULT_BUCKET_BYTES
from .verify import (
    FIX,
    PieceCheck,
    ReadBack,
    bucket_checksums,
    compare,
    corrupt,
    loaded_bytes,
    tensors_checksums,
    word_size,
)
from .wire import tensor_bytes


@dataclass(frozen=True)
class IpcHandle:
    """How to map a bucket buffer in another process: ``kind`` "cuda" (torch's IPC rebuild args) or "shm" (a path)."""

    kind: str
    payload: Any
    nbytes: int
    device_uuid: str = ""  # cuda: which physical GPU (device indices differ between processes)


@dataclass(frozen=True)
class IpcBucket:
    """One packed bucket as the engine receives it: a handle and ``(meta, byte offset)`` of each tensor in it.

    ``last``: the sync's final delivery (possibly with no entries); the receiver then drops its mappings, so the
    sender's memory is really freed when it is released. ``reusable``: the buffer comes back in later buckets, so
    the receiver keeps it mapped until ``last`` (mapping a CUDA IPC handle is not free). ``checked``: per entry,
    whether this sync checks it (None: none checked). ``sums``: ``(bucket index, the sender's checksums of that
    bucket's checked entries, in order)`` -- this bucket's own when it is the sync's last or travels alone, else the
    bucket before it (computed while the engine loaded that one). ``sync``: which sync of which sender this bucket
    belongs to (the receiver keeps a sync's pending checks under it).
    """

    index: int
    handle: IpcHandle | None
    entries: tuple[tuple[TensorMeta, int], ...]
    last: bool = False
    reusable: bool = True
    checked: tuple[bool, ...] | None = None
    sums: tuple[tuple[int, tuple[int, ...]], ...] = ()
    sync: str = ""

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m, _ in self.entries)


class IpcBucketSender:
    """Packs ``(name, tensor)`` streams into shared buckets on ``device`` (default: the current CUDA device, else CPU).

    The two bucket buffers stay allocated between ``send`` calls (the engine keeps its mapping of them too);
    ``close()`` frees them. ``verify``: which tensors' checksums the buckets carry (as for
    :class:`~hybrid_core.weight_sync.sender.WeightSender`: a policy, a mode name, True or False).
    """

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str | None = None,
        *,
        verify: bool | str | VerifyPolicy = True,
    ):
        check_bucket_bytes(bucket_bytes)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cuda", "cpu"):
            raise ConfigError(
                "device",
                f"IPC buckets need a CUDA or CPU device, got {self.device}.",
                "Pass the trainer's CUDA device.",
            )
        self.bucket_bytes, self.verify = bucket_bytes, verify
        self._slots: list[_SharedBuffer] = []
        self._sends = 0  # checked sends so far (a mode name's sync number)
        self._late: list[tuple[int, torch.Tensor]] = []
        self._sync = ""

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        deliver: Callable[[IpcBucket], Any],
        wait: Callable[[Any], None],
    ) -> TransferStats:
        """For each packed bucket call ``deliver(bucket)`` (returns e.g. Ray refs) and, before reusing its buffer or
        returning, ``wait(what deliver returned)``. At most two buckets are in flight."""
        start = time.perf_counter()
        policy = as_policy(self.verify, self._sends)
        self._sends += policy.active
        rotation = Rotation(policy)
        if not self._slots:
            self._slots = [_SharedBuffer(self.bucket_bytes, self.device) for _ in range(2)]
        packer = BucketPacker(self.bucket_bytes, split_large=False)
        inflight: list[Any] = [None, None]
        pieces: list[Piece] = []
        checked: list[bool] = []
        payload = 0
        self._late = []  # (bucket index, device checksums) launched after a hand-over, sent with the next bucket
        self._sync = uuid.uuid4().hex
        with torch.no_grad():
            for name, tensor in named_tensors:
                meta = TensorMeta.of(name, tensor)
                payload += meta.nbytes
                (piece,) = packer.add(meta)
                if pieces and piece.bucket != pieces[0].bucket:
                    inflight[pieces[0].bucket % 2] = self._hand_over(
                        self._slots[pieces[0].bucket % 2], pieces, checked, deliver
                    )
                    pieces, checked = [], []
                slot = piece.bucket % 2
                if not pieces and inflight[slot] is not None:  # opening a bucket: the engine must be done with it
                    wait(inflight[slot])
                    inflight[slot] = None
                if piece.nbytes > self.bucket_bytes:  # oversize: alone, in a buffer of its own size
                    alone = _SharedBuffer(piece.nbytes, self.device)
                    alone.tensor.copy_(tensor_bytes(tensor))
                    wait(self._hand_over(alone, [piece], [rotation.take(piece.nbytes)], deliver, alone=True))
                    alone.release()
                    continue
                buf = self._slots[slot].tensor
                buf[piece.bucket_offset : piece.bucket_offset + piece.nbytes].copy_(
                    tensor_bytes(tensor), non_blocking=self.device.type == "cuda"
                )  # a host bucket is read at once
                pieces.append(piece)
                checked.append(rotation.take(piece.nbytes))
            if pieces:
                inflight[pieces[0].bucket % 2] = self._hand_over(
                    self._slots[pieces[0].bucket % 2], pieces, checked, deliver, last=True
                )
            else:  # nothing pending (empty stream, or it ended with an oversize tensor): a bare end marker
                _sync_stream(self.device)
                end = packer.bucket + int(packer.filled)
                wait(deliver(IpcBucket(end, None, (), last=True, sums=self._late_sums(), sync=self._sync)))
            for refs in inflight:
                if refs is not None:
                    wait(refs)
        return TransferStats(payload, time.perf_counter() - start, "weight sync ipc")

    def _hand_over(
        self,
        buffer: _SharedBuffer,
        pieces: list[Piece],
        checked: list[bool],
        deliver: Callable[[IpcBucket], Any],
        *,
        last: bool = False,
        alone: bool = False,
    ) -> Any:
        """Deliver one bucket. Its checked pieces' checksums are computed before the hand-over only where nothing
        comes after it to carry them (the sync's last bucket; a buffer of its own, freed once delivered): otherwise
        after it, on the device, while the engine loads (``_late``, read at the next hand-over's synchronize)."""
        chosen = [p for p, c in zip(pieces, checked) if c]
        now = alone or last
        own = bucket_checksums(buffer.tensor, chosen) if chosen and now else None
        _sync_stream(self.device)  # the other process cannot see our stream
        sums = self._late_sums()
        if own is not None:
            sums += ((pieces[0].bucket, tuple(own.tolist())),)
        bucket = IpcBucket(
            pieces[0].bucket,
            buffer.handle(),
            tuple((p.meta, p.bucket_offset) for p in pieces),
            last=last,
            reusable=not alone,
            checked=tuple(checked) if chosen else None,
            sums=sums,
            sync=self._sync,
        )
        refs = deliver(bucket)
        if chosen and not now:  # the same stream as the next packing: done before this buffer is packed again
            self._late.append((pieces[0].bucket, bucket_checksums(buffer.tensor, chosen)))
        return refs

    def _late_sums(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """The checksums launched after earlier hand-overs, as host values (the stream was just synchronized)."""
        late = tuple((index, tuple(sums.tolist())) for index, sums in self._late)
        self._late = []
        return late

    def close(self) -> None:
        for slot in self._slots:
            slot.release()
        self._slots = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass


def engine_group_callbacks(
    peers: Sequence[int],
    submit: Callable[[list[IpcBucket]], Any],
    wait_submitted: Callable[[Any], None],
    *,
    group: Any = None,
) -> tuple[Callable[[IpcBucket], Any], Callable[[Any], None]]:
    """``deliver``/``wait`` for :meth:`IpcBucketSender.send` when one engine spans the GPUs of trainer ranks ``peers``.

    Every rank of ``group`` (torch.distributed; the trainer's own group by default) must call ``send`` with the same
    tensor stream, so all pack the same buckets in step. Per bucket, the handles are gathered; the first rank of
    ``peers`` submits its engine's list (``submit``, e.g. a Ray call) and, in ``wait``, waits for it
    (``wait_submitted``); then all ranks pass a barrier, so no rank reuses or frees a buffer the engine still reads.
    The group's own timeout bounds the collectives.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peers = list(peers)
    if rank not in peers:
        raise ValueError(f"trainer rank {rank} is not among the engine's ranks {peers}")
    leads = rank == peers[0]

    def deliver(bucket: IpcBucket) -> Any:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, bucket, group=group)
        return ("submitted", submit([gathered[p] for p in peers])) if leads else ("follower", None)

    def wait(token: Any) -> None:
        kind, ref = token
        if kind == "submitted":
            wait_submitted(ref)
        dist.all_gather_object([None] * world, None, group=group)  # the barrier: the engine is done with the bucket

    return deliver, wait


def open_ipc_bucket(bucket: IpcBucket) -> list[tuple[str, torch.Tensor]]:
    """Receiver side: ``(name, tensor)`` views into the shared bucket; copy them before the sender reuses it."""
    if bucket.handle is None:
        return []
    key = _handle_key(bucket.handle)
    buf = _MAPPED.get(key)
    if buf is None:
        buf = _map(bucket.handle)
        if bucket.reusable:
            _MAPPED[key] = buf
            while len(_MAPPED) > _MAX_MAPPED:
                _MAPPED.pop(next(iter(_MAPPED)))
    return [
        (meta.name, buf[offset : offset + meta.nbytes].view(meta.torch_dtype).view(meta.shape))
        for meta, offset in bucket.entries
    ]


def load_ipc_bucket(
    bucket: IpcBucket, load: Callable[[list[tuple[str, torch.Tensor]]], None], read_back: ReadBack | None = None
) -> TransferStats:
    """Receiver side in one call: map, ``load(pairs)`` (which copies), wait for the copies; checksum this sync's
    checked entries (over ``read_back(name)``, the engine's tensor filled for ``name``, where it gives one: launched
    after the wait, nothing waits for it; else over the mapped bytes, before the wait: the sender reuses them); at the
    sync's last bucket compare every checksum of the sync with the sender's (one host read). After the last bucket
    (or a mismatch), unmap everything."""
    start = time.perf_counter()
    if bucket.index == 0:
        release_ipc_mappings()  # a new sync: mappings of an earlier one are stale
    pairs = open_ipc_bucket(bucket)
    try:
        if pairs and faults.corrupt_due("receiver", "bucket"):  # HYBRID_FAULT=receiver:bucket:corrupt (tests)
            # what the engine reads differs from what was packed (a wrong or stale mapping); the sender's buffer
            # itself stays as packed, as the sender checksums it after the hand-over
            name, tensor = pairs[0]
            pairs[0] = (name, tensor.clone())
            corrupt(tensor_bytes(pairs[0][1]))
        checks = _checks_of(bucket)
        if pairs:
            load(pairs)
        later = _check_bucket(bucket, pairs, read_back, checks)
        if pairs and bucket.handle is not None and bucket.handle.kind == "cuda":
            torch.cuda.current_stream(pairs[0][1].device).synchronize()  # the copies done: the sender may reuse
        if later is not None:
            later()
        if checks.done(bucket):  # every bucket of the sync is in (an engine may take them out of order)
            _PENDING.pop(bucket.sync, None)
            checks.compare()
    except BaseException:
        release_ipc_mappings()
        _PENDING.pop(bucket.sync, None)
        raise
    del pairs
    if bucket.last:
        release_ipc_mappings()
    return TransferStats(bucket.nbytes, time.perf_counter() - start, "weight sync ipc")


class _SyncChecks:
    """One sync's checks on the receiving side: the engine's checksums per bucket (device tensors, not yet read) and
    the sender's (which may come a bucket later); :meth:`compare` reads them all at once."""

    def __init__(self) -> None:
        self.ours: dict[int, tuple[list[PieceCheck], torch.Tensor]] = {}
        self.theirs: dict[int, tuple[int, ...]] = {}
        self.seen: set[int] = set()
        self.end: int | None = None  # the last bucket's index, once it came
        self.lock = threading.Lock()  # an engine with max_concurrency > 1 may load two buckets at once

    def done(self, bucket: IpcBucket) -> bool:
        """Record that ``bucket`` is loaded (and the sender's checksums it carries); True once, when the whole sync
        is (the bucket indices of a sync are 0..last, every one delivered)."""
        with self.lock:
            for index, sums in bucket.sums:
                self.theirs[index] = tuple(sums)
            self.seen.add(bucket.index)
            if bucket.last:
                self.end = bucket.index
            return self.end is not None and len(self.seen) == self.end + 1

    def compare(self) -> None:
        indices = sorted(set(self.ours) | set(self.theirs))
        one_sided = [i for i in indices if i not in self.ours or i not in self.theirs]
        if one_sided:
            raise WeightSyncMismatch(
                f"weight sync verify: IPC receiver: bucket(s) {one_sided[:5]} have checksums on one side only "
                f"(sent for {sorted(self.theirs)[:5]}, checked in {sorted(self.ours)[:5]}). Fix: {FIX}"
            )
        if not indices:
            return
        for i in indices:
            if len(self.theirs[i]) != len(self.ours[i][0]):
                raise WeightSyncMismatch(
                    f"weight sync verify: IPC receiver: {len(self.theirs[i])} checksums for the "
                    f"{len(self.ours[i][0])} checked tensors of bucket {i}. Fix: {FIX}"
                )
        checks = [c for i in indices for c in self.ours[i][0]]
        sent = [v for i in indices for v in self.theirs[i]]
        compare(sent, torch.cat([self.ours[i][1] for i in indices]), checks, "IPC receiver")


def _checks_of(bucket: IpcBucket) -> _SyncChecks:
    """This sync's pending checks (by the sender's id of the sync, whatever order its buckets come in)."""
    with _PENDING_LOCK:
        checks = _PENDING.get(bucket.sync)
        if checks is None:
            checks = _PENDING[bucket.sync] = _SyncChecks()
            while len(_PENDING) > _MAX_PENDING:  # syncs abandoned half-way (a sender that failed)
                _PENDING.pop(next(iter(_PENDING)))
        return checks


def _check_bucket(
    bucket: IpcBucket, pairs: list[tuple[str, torch.Tensor]], read_back: ReadBack | None, checks: _SyncChecks
) -> Callable[[], None] | None:
    """Checksum the bucket's checked entries (one launch where the device has the kernel). Read back from the
    engine's tensors, they are returned as a callable for after the caller's wait (nothing waits for them); read
    from the mapped bytes, they run now, before the wait (the sender reuses the buffer after it)."""
    if bucket.checked is None:
        return None
    if len(bucket.checked) != len(pairs):
        raise WeightSyncMismatch(
            f"weight sync verify: IPC receiver: {len(bucket.checked)} check marks for {len(pairs)} "
            f"tensors in bucket {bucket.index}. Fix: {FIX}"
        )
    named: list[PieceCheck] = []
    datas: list[torch.Tensor] = []
    sizes: list[int] = []
    for (name, tensor), (meta, _), want in zip(pairs, bucket.entries, bucket.checked):
        if not want:  # not checked in this sync (sampling.py)
            continue
        data, from_engine = loaded_bytes(name, tensor, meta, read_back)
        named.append(PieceCheck(name, bucket.index, 0, meta.nbytes, meta.nbytes, from_engine))
        datas.append(data)
        sizes.append(word_size(meta, 0, meta.nbytes))

    def run() -> None:
        sums = tensors_checksums(datas, sizes)
        with checks.lock:
            checks.ours[bucket.index] = (named, sums)

    if not named:
        return None
    if all(c.read_back for c in named):
        return run
    run()
    return None


def release_ipc_mappings() -> None:
    """Unmap the buckets this process keeps mapped, so the sender's memory can really be freed."""
    _MAPPED.clear()


# Bucket buffers mapped in this (receiver) process, kept while a sync lasts (the sender alternates two of them).
_MAPPED: dict[tuple[Any, ...], torch.Tensor] = {}
_MAX_MAPPED = 2
# The checks of the syncs under way in this (receiver) process, by IpcBucket.sync.
_PENDING: dict[str, _SyncChecks] = {}
_PENDING_LOCK = threading.Lock()
_MAX_PENDING = 8


def _handle_key(handle: IpcHandle) -> tuple[Any, ...]:
    if handle.kind == "cuda":
        args = handle.payload
        return handle.kind, handle.device_uuid, bytes(args[7]), args[9], handle.nbytes  # memory handle + offset
    return handle.kind, handle.payload, handle.nbytes


# ---- shared buffers ------------------------------------------------------------------------------------------------
class _SharedBuffer:
    """A uint8 buffer another process can map: CUDA memory with an IPC handle, or a file in shared memory."""

    def __init__(self, nbytes: int, device: torch.device):
        self.path = None
        self.nbytes = nbytes
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.device_uuid = str(torch.cuda.get_device_properties(device).uuid)
        else:
            self.path = os.path.join(_shm_dir(), f"hybrid-ipc-{os.getpid()}-{uuid.uuid4().hex}")
            self.tensor = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)

    def handle(self) -> IpcHandle:
        """A fresh handle per delivery: torch's CUDA IPC counts each one as a reference the receiver releases."""
        if self.path is not None:
            return IpcHandle("shm", self.path, self.nbytes)
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.tensor)
        return IpcHandle("cuda", args, self.nbytes, self.device_uuid)

    def release(self) -> None:
        if self.path is not None and os.path.exists(self.path):
            os.unlink(self.path)  # mappings already open elsewhere stay valid
        self.path = None
        self.tensor = None


def _sync_stream(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _map(handle: IpcHandle) -> torch.Tensor:
    if handle.kind == "shm":
        return torch.from_file(handle.payload, shared=True, size=handle.nbytes, dtype=torch.uint8)
    if handle.kind != "cuda":
        raise ConfigError("IpcHandle.kind", f"unknown kind {handle.kind!r}.", "Use buckets from IpcBucketSender.")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(handle.payload)
    args[6] = _local_device_index(handle.device_uuid)  # the sender's index for this GPU may differ from ours
    return rebuild_cuda_tensor(*args)


def _local_device_index(device_uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == device_uuid:
            return i
    raise ConfigError(
        "weight_sync",
        f"this process does not see the sender's GPU (uuid {device_uuid}), so CUDA IPC cannot work.",
        "Colocate the engine on the trainer's GPU, or use the broadcast path.",
    )


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
