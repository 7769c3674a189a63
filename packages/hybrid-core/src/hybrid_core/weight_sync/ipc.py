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

Verification (``verify``, the default: ``sampled``, see ``sampling.py``): a bucket carries the checksum of each
tensor this sync checks (``verify.py``), computed on the device before the hand-over (the sender synchronizes there
anyway); the receiver recomputes them after its load, over the engine's tensors where ``read_back`` gives them, and
raises :class:`~hybrid_core.errors.WeightSyncMismatch` naming the parameter before it acknowledges the bucket.
"""

from __future__ import annotations

import os
import tempfile
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
    the receiver keeps it mapped until ``last`` (mapping a CUDA IPC handle is not free). ``checksums``: the sender's
    checksum of each entry, None for an entry this sync does not check (the whole field None: none checked).
    """

    index: int
    handle: IpcHandle | None
    entries: tuple[tuple[TensorMeta, int], ...]
    last: bool = False
    reusable: bool = True
    checksums: tuple[int | None, ...] | None = None

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
                wait(deliver(IpcBucket(packer.bucket + int(packer.filled), None, (), last=True)))
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
        sums = bucket_checksums(buffer.tensor, chosen) if chosen else None
        return _bucket(buffer, pieces, last=last, reusable=reusable, sums=sums, checked=checked)

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
    bucket's checksums (over ``read_back(name)``, the engine's tensor filled for ``name``, where it gives one; else
    over the mapped bytes); after the last bucket of a sync (or a mismatch), unmap everything."""
    start = time.perf_counter()
    if bucket.index == 0:
        release_ipc_mappings()  # a new sync: mappings of an earlier one are stale
    pairs = open_ipc_bucket(bucket)
    try:
        if pairs and faults.corrupt_due("receiver", "bucket"):  # HYBRID_FAULT=receiver:bucket:corrupt (tests)
            corrupt(tensor_bytes(pairs[0][1]))
        if pairs:
            load(pairs)
            if bucket.checksums is not None:
                _verify(bucket, bucket.checksums, pairs, read_back)
            elif bucket.handle is not None and bucket.handle.kind == "cuda":
                torch.cuda.current_stream(pairs[0][1].device).synchronize()
    except BaseException:
        release_ipc_mappings()
        raise
    del pairs
    if bucket.last:
        release_ipc_mappings()
    return TransferStats(bucket.nbytes, time.perf_counter() - start, "weight sync ipc")


def _verify(
    bucket: IpcBucket, expected: Sequence[int | None], pairs: list[tuple[str, torch.Tensor]], read_back: ReadBack | None
) -> None:
    actual, checks, sent = [], [], []
    if len(expected) != len(pairs):
        raise WeightSyncMismatch(
            f"weight sync verify: IPC receiver: {len(expected)} checksums for {len(pairs)} "
            f"tensors in bucket {bucket.index}. Fix: {FIX}"
        )
    sizes = []
    for (name, tensor), (meta, _), want in zip(pairs, bucket.entries, expected):
        if want is None:  # not checked in this sync (sampling.py)
            continue
        data, from_engine = loaded_bytes(name, tensor, meta, read_back)
        actual.append(data)
        sizes.append(word_size(meta, 0, meta.nbytes))
        checks.append(PieceCheck(name, bucket.index, 0, meta.nbytes, meta.nbytes, from_engine))
        sent.append(want)
    if not actual:
        if pairs[0][1].device.type == "cuda":
            torch.cuda.current_stream(pairs[0][1].device).synchronize()
        return
    compare(sent, tensors_checksums(actual, sizes), checks, "IPC receiver")  # the host read waits for the load


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
