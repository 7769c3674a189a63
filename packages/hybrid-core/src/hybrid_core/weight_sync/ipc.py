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

Verification (``verify``, the default: ``sampled``, see ``sampling.py``): a bucket says which of its tensors this
sync checks (``checked``), the sender computes their checksums on the device (``verify.py``) and the receiver
recomputes them after its load, over the engine's tensors where ``read_back`` gives them, else over the bytes that
arrived; a difference raises :class:`~hybrid_core.errors.WeightSyncMismatch` naming the parameter. Neither side puts
its checksums on the sync's critical path when it need not (issue 34: a check may cost <= 2 % of a sync):

* the sender launches a bucket's checksums *after* handing it over (they run while the engine loads) and sends the
  values with its next delivery (``previous_checksums``); only the sync's last delivery, which nothing follows, and a
  tensor sent alone (waited for at once) carry their own (``checksums``);
* the receiver launches its checksums right after the load's copies, before it waits for them (measured on an
  H200: launching after the wait, to keep the kernels off the acknowledgement, cost more than the kernels), reading
  the engine's tensors in place (``checksum_kernel.tensors_checksums``: no copy), and compares when the sender's
  values are there: with the bucket, or with the next delivery (a receiver that takes deliveries out of order may
  get them first). So a mismatch ends the sync at the next bucket at the latest, and a sync never completes
  unchecked.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
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
    the receiver keeps it mapped until ``last`` (mapping a CUDA IPC handle is not free). ``checked``: which entries
    this sync checks (None: none, unless ``checksums`` says). ``checksums``: the sender's checksum of each entry (None
    for an unchecked one), when they travel with the bucket; else they come with the next delivery, as its
    ``previous_checksums`` (the module's docstring says why).
    """

    index: int
    handle: IpcHandle | None
    entries: tuple[tuple[TensorMeta, int], ...]
    last: bool = False
    reusable: bool = True
    checksums: tuple[int | None, ...] | None = None
    checked: tuple[bool, ...] | None = None
    previous_checksums: tuple[int | None, ...] | None = None
    sender: str = ""  # which sender (one receiver may load several: an engine spanning GPUs, in one process)
    sync: int = 0  # the sender's sync it belongs to (a receiver may see the first delivery of a sync late)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m, _ in self.entries)

    def checks(self) -> tuple[bool, ...]:
        """Whether each entry is checked in this sync."""
        if self.checked is not None:
            return self.checked
        if self.checksums is not None:
            return tuple(c is not None for c in self.checksums)
        return (False,) * len(self.entries)


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
        # the last delivery's checksums, launched after its hand-over: (values on the device, its checked flags)
        self._deferred: tuple[torch.Tensor, list[bool]] | None = None
        self._id = uuid.uuid4().hex
        self._sync = 0  # send() calls so far: each sync's deliveries carry its number

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
        self._deferred = None
        self._sync += 1
        if not self._slots:
            self._slots = [_SharedBuffer(self.bucket_bytes, self.device) for _ in range(2)]
        packer = BucketPacker(self.bucket_bytes, split_large=False)
        inflight: list[Any] = [None, None]
        pieces: list[Piece] = []
        checked: list[bool] = []
        payload = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                meta = TensorMeta.of(name, tensor)
                payload += meta.nbytes
                (piece,) = packer.add(meta)
                if pieces and piece.bucket != pieces[0].bucket:
                    inflight[pieces[0].bucket % 2] = deliver(
                        self._bucket(self._slots[pieces[0].bucket % 2], pieces, checked)
                    )
                    pieces, checked = [], []
                slot = piece.bucket % 2
                if not pieces and inflight[slot] is not None:  # opening a bucket: the engine must be done with it
                    wait(inflight[slot])
                    inflight[slot] = None
                if piece.nbytes > self.bucket_bytes:  # oversize: alone, in a buffer of its own size
                    alone = _SharedBuffer(piece.nbytes, self.device)
                    alone.tensor.copy_(tensor_bytes(tensor))
                    wait(deliver(self._bucket(alone, [piece], [rotation.take(piece.nbytes)], reusable=False)))
                    alone.release()
                    continue
                buf = self._slots[slot].tensor
                buf[piece.bucket_offset : piece.bucket_offset + piece.nbytes].copy_(
                    tensor_bytes(tensor), non_blocking=self.device.type == "cuda"
                )  # a host bucket is read at once
                pieces.append(piece)
                checked.append(rotation.take(piece.nbytes))
            if pieces:
                inflight[pieces[0].bucket % 2] = deliver(
                    self._bucket(self._slots[pieces[0].bucket % 2], pieces, checked, last=True)
                )
            else:  # nothing pending (empty stream, or it ended with an oversize tensor): a bare end marker
                end = IpcBucket(
                    packer.bucket + int(packer.filled),
                    None,
                    (),
                    last=True,
                    previous_checksums=self._take_deferred(),
                    sender=self._id,
                    sync=self._sync,
                )
                wait(deliver(end))
            for refs in inflight:
                if refs is not None:
                    wait(refs)
        return TransferStats(payload, time.perf_counter() - start, "weight sync ipc")

    def _bucket(
        self,
        buffer: _SharedBuffer,
        pieces: list[Piece],
        checked: list[bool],
        *,
        last: bool = False,
        reusable: bool = True,
    ) -> IpcBucket:
        chosen = [p for p, c in zip(pieces, checked) if c]
        # the last delivery and a tensor sent alone (waited for at once) have no later delivery to carry their sums
        now = bool(chosen) and (last or not reusable)
        sums = bucket_checksums(buffer.tensor, chosen) if now else None
        bucket = _bucket(buffer, pieces, last=last, reusable=reusable, sums=sums, checked=checked)
        bucket = dataclasses.replace(bucket, previous_checksums=self._take_deferred(), sender=self._id, sync=self._sync)
        if chosen and not now:  # launched after the hand-over's synchronize: it runs while the engine loads
            self._deferred = (bucket_checksums(buffer.tensor, chosen), list(checked))
        return bucket

    def _take_deferred(self) -> tuple[int | None, ...] | None:
        """The previous delivery's checksums, one per entry (None: unchecked), for this delivery to carry."""
        if self._deferred is None:
            return None
        sums, checked = self._deferred
        self._deferred = None
        values = iter(sums.tolist())  # long done: the engine loaded that bucket meanwhile
        return tuple(next(values) if c else None for c in checked)

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
    """Receiver side in one call: map, ``load(pairs)`` (which copies), wait for the copies, check them against the
    sender's checksums (over ``read_back(name)``, the engine's tensor filled for ``name``, where it gives one; else
    over the mapped bytes: the module's docstring says when each comparison happens); after the last bucket of a
    sync (or a mismatch), unmap everything."""
    start = time.perf_counter()
    if bucket.index == 0:
        release_ipc_mappings()  # a new sync: mappings of an earlier one are stale
    state = _sync_checks(bucket)
    try:
        if bucket.previous_checksums is not None:
            state.arrived(bucket.index - 1, bucket.previous_checksums)
        pairs = open_ipc_bucket(bucket)
        if pairs and faults.corrupt_due("receiver", "bucket"):  # HYBRID_FAULT=receiver:bucket:corrupt (tests)
            corrupt(tensor_bytes(pairs[0][1]))
        if pairs:
            load(pairs)
            state.check(bucket, pairs, read_back)
        state.delivered(bucket)
        if state.complete():
            del _SYNCS[bucket.sender, bucket.sync]
    except BaseException:
        release_ipc_mappings()
        _SYNCS.pop((bucket.sender, bucket.sync), None)
        raise
    del pairs
    if bucket.last:
        release_ipc_mappings()
    return TransferStats(bucket.nbytes, time.perf_counter() - start, "weight sync ipc")


@dataclass
class _OpenCheck:
    """A bucket's check waiting for the sender's values: the receiver's checksums (on the device) and what each
    names."""

    bucket: int
    positions: list[int]  # the checked entries' places in the bucket
    checks: list[PieceCheck]
    actual: torch.Tensor

    def compare(self, sent: Sequence[int | None]) -> None:
        """Raise :class:`WeightSyncMismatch` naming every piece that differs (or whose value never came)."""
        got = [sent[i] if i < len(sent) else None for i in self.positions]
        want = [v for v in got if v is not None]
        if len(want) < len(got):
            raise WeightSyncMismatch(
                f"weight sync verify: IPC receiver: no checksum came for a checked tensor of bucket {self.bucket}. "
                f"Fix: {FIX}"
            )
        compare(want, self.actual, self.checks, "IPC receiver")


@dataclass
class _SyncChecks:
    """One sender's sync as this receiver sees it. The sender's values for a bucket come with it or with the next
    delivery; a receiver may take deliveries out of order (e.g. one that reads a bucket only when the sender waits
    for it), so values may come before their bucket (``early``) and a check waits for them (``open``). The sync is
    complete when every delivery up to the last has come; a check still open then never got its values."""

    open: dict[int, _OpenCheck] = field(default_factory=dict)
    early: dict[int, Sequence[int | None]] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)
    last: int | None = None

    def arrived(self, index: int, sent: Sequence[int | None]) -> None:
        if index in self.open:
            self.open.pop(index).compare(sent)
        elif index in self.seen:
            if any(v is not None for v in sent):
                raise WeightSyncMismatch(
                    f"weight sync verify: IPC receiver: checksums came for bucket {index}, which it did not check. "
                    f"Fix: {FIX}"
                )
        else:
            self.early[index] = sent

    def check(self, bucket: IpcBucket, pairs: list[tuple[str, torch.Tensor]], read_back: ReadBack | None) -> None:
        """Check this bucket: its checksums launched behind the load's copies, then the wait for both (the sender may
        reuse the buffer once we return); compared now when the sender's values are here, else when they come."""
        flags = bucket.checks()
        if len(flags) != len(pairs) or (bucket.checksums is not None and len(bucket.checksums) != len(pairs)):
            raise WeightSyncMismatch(
                f"weight sync verify: IPC receiver: checksums for {len(flags)} tensors in bucket {bucket.index} of "
                f"{len(pairs)}. Fix: {FIX}"
            )
        positions, checks, datas, sizes = [], [], [], []
        for i, ((name, tensor), (meta, _), flag) in enumerate(zip(pairs, bucket.entries, flags)):
            if not flag:  # not checked in this sync (sampling.py)
                continue
            data, from_engine = loaded_bytes(name, tensor, meta, read_back)
            positions.append(i)
            checks.append(PieceCheck(name, bucket.index, 0, meta.nbytes, meta.nbytes, from_engine))
            datas.append(data)
            sizes.append(word_size(meta, 0, meta.nbytes))
        actual = tensors_checksums(datas, sizes) if datas else None
        device = pairs[0][1].device
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the load's copies and the checksums are done
        if actual is None:
            return
        opened = _OpenCheck(bucket.index, positions, checks, actual)
        sent = bucket.checksums if bucket.checksums is not None else self.early.pop(bucket.index, None)
        if sent is not None:
            opened.compare(sent)
        else:
            self.open[bucket.index] = opened

    def delivered(self, bucket: IpcBucket) -> None:
        self.seen.add(bucket.index)
        if bucket.last:
            self.last = bucket.index

    def complete(self) -> bool:
        """Every delivery up to the last has come: raise if a check never got the sender's values."""
        if self.last is None or len(self.seen) < self.last + 1:
            return False
        if self.open:
            index = min(self.open)
            raise WeightSyncMismatch(
                f"weight sync verify: IPC receiver: the sender's checksums for bucket {index} never came. Fix: {FIX}"
            )
        return True


def _sync_checks(bucket: IpcBucket) -> _SyncChecks:
    """The checks of the bucket's sync; a sender's older syncs still here failed part-way: dropped."""
    key = (bucket.sender, bucket.sync)
    state = _SYNCS.get(key)
    if state is None:
        for stale in [k for k in _SYNCS if k[0] == bucket.sender and k[1] < bucket.sync]:
            del _SYNCS[stale]
        state = _SYNCS[key] = _SyncChecks()
    return state


# Per (sender, sync) of the IpcBuckets: the checks of that sync.
_SYNCS: dict[tuple[str, int], _SyncChecks] = {}


def release_ipc_mappings() -> None:
    """Unmap the buckets this process keeps mapped, so the sender's memory can really be freed."""
    _MAPPED.clear()


# Bucket buffers mapped in this (receiver) process, kept while a sync lasts (the sender alternates two of them).
_MAPPED: dict[tuple[Any, ...], torch.Tensor] = {}
_MAX_MAPPED = 2


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


def _bucket(
    buffer: _SharedBuffer,
    pieces: list[Piece],
    *,
    last: bool = False,
    reusable: bool = True,
    sums: torch.Tensor | None = None,
    checked: Sequence[bool] = (),
) -> IpcBucket:
    if buffer.tensor.device.type == "cuda":
        torch.cuda.current_stream(buffer.tensor.device).synchronize()  # the other process cannot see our stream
    checksums = None
    if sums is not None:
        values = iter(sums.tolist())
        checksums = tuple(next(values) if c else None for c in checked)
    return IpcBucket(
        pieces[0].bucket,
        buffer.handle(),
        tuple((p.meta, p.bucket_offset) for p in pieces),
        last=last,
        reusable=reusable,
        checksums=checksums,
        checked=tuple(bool(c) for c in checked) if any(checked) else None,
    )


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
