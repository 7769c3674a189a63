"""Rank 0 of the weight-sync group: packs named tensors into flat buckets and broadcasts them.

Two bucket buffers alternate (double buffering): while one is on the wire, the next is being packed. The stream of
tensors may be lazy (ZeRO-3 gathers one parameter at a time and frees it when the generator advances); each
tensor's bytes are copied into the bucket before the next one is asked for.

With ``verify`` (the default: ``sampled``, ``sampling.py``) each bucket holding a checked piece is followed by those
pieces' checksums (``verify.py``), computed on the device after the payload was put on the wire, so they overlap
the transfer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from ..errors import ConfigError
from ..stats import TransferStats
from .buckets import BucketPacker, Piece, check_bucket_bytes, used_bytes
from .group import PendingWork, SyncGroup
from .meta import TensorMeta
from .sampling import Rotation, VerifyPolicy, as_policy
from .verify import bucket_checksums
from .wire import end_tensor, handshake_tensor, header_tensor, tensor_bytes

DEFAULT_BUCKET_BYTES = 512 << 20


class WeightSender:
    """Sends a stream of ``(name, tensor)`` to every other rank of ``group`` (which must be rank 0 here).

    The buffers (2 x ``bucket_bytes`` on the group's device) are kept between ``send`` calls; ``close()`` frees them.
    ``verify``: which pieces' checksums to send, so the receivers check what they loaded (they follow the handshake
    and headers): a :class:`~hybrid_core.weight_sync.sampling.VerifyPolicy`; a mode name ("full", "sampled", "off":
    then this sender numbers its own sends, the first checked in full); True (every piece) or False.
    """

    def __init__(
        self, group: SyncGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, verify: bool | str | VerifyPolicy = True
    ):
        check_bucket_bytes(bucket_bytes)
        if group.rank != 0:
            raise ConfigError(
                "rank",
                f"the weight sender must be rank 0 of the sync group, this is rank {group.rank}.",
                "Create the sender on the trainer's rank 0; engine workers use WeightReceiver.",
            )
        self.group, self.bucket_bytes, self.verify = group, bucket_bytes, verify
        self._buffers: list[torch.Tensor] = []
        self._sends = 0  # checked sends so far (a mode name's sync number)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> TransferStats:
        """Broadcast every tensor; returns the payload bytes and the time from the first byte to the last delivered."""
        g = self.group
        policy = as_policy(self.verify, self._sends)
        self._sends += policy.active
        rotation = Rotation(policy)
        g.broadcast(
            handshake_tensor(self.bucket_bytes, g.device, verify=policy.active), what="weight sync handshake"
        ).wait()
        if not self._buffers:
            self._buffers = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=g.device) for _ in range(2)]
        start = time.perf_counter()
        packer = BucketPacker(self.bucket_bytes)
        inflight: list[list[PendingWork]] = [[], []]
        pieces: list[Piece] = []
        checked: list[int] = []  # indices in the open bucket of the pieces this sync checks
        payload = 0
        on_device = g.device.type == "cuda"  # async copies only into device buckets (a host bucket is read at once)
        with torch.no_grad():
            for name, tensor in named_tensors:
                meta = TensorMeta.of(name, tensor)
                src = tensor_bytes(tensor)
                payload += meta.nbytes
                for piece in packer.add(meta):
                    if pieces and piece.bucket != pieces[0].bucket:
                        inflight[pieces[0].bucket % 2] = self._flush(pieces, checked)
                        pieces, checked = [], []
                    if not pieces:  # opening a bucket: its buffer must be off the wire
                        for work in inflight[piece.bucket % 2]:
                            work.wait()
                        inflight[piece.bucket % 2] = []
                    buf = self._buffers[piece.bucket % 2]
                    buf[piece.bucket_offset : piece.bucket_offset + piece.nbytes].copy_(
                        src[piece.tensor_offset : piece.tensor_offset + piece.nbytes], non_blocking=on_device
                    )
                    if rotation.take(piece.nbytes):
                        checked.append(len(pieces))
                    pieces.append(piece)
            if pieces:
                inflight[pieces[0].bucket % 2] = self._flush(pieces, checked)
            n_buckets = pieces[0].bucket + 1 if pieces else 0
            end = g.broadcast(end_tensor(n_buckets, g.device), what="weight sync end")
            for work in [*inflight[0], *inflight[1], end]:
                work.wait()
        if g.device.type == "cuda":
            torch.cuda.current_stream(g.device).synchronize()
        return TransferStats(payload, time.perf_counter() - start, "weight sync")

    def _flush(self, pieces: list[Piece], checked: list[int]) -> list[PendingWork]:
        """Announce the bucket's layout (and how many of its pieces are checked), then put its bytes on the wire, then
        the checked pieces' indices and checksums (all asynchronous, in this order; the checksums are computed while
        the payload is on the wire)."""
        index = pieces[0].bucket
        g = self.group
        header = g.broadcast(
            header_tensor(index, pieces, g.device, len(checked)), what=f"weight sync bucket {index} header"
        )
        buf = self._buffers[index % 2]
        works = [header, g.broadcast(buf[: used_bytes(pieces)], what=f"weight sync bucket {index}")]
        if checked:
            sums = bucket_checksums(buf, [pieces[i] for i in checked])
            which = torch.tensor(checked, dtype=torch.int64).to(g.device, non_blocking=True)
            works.append(g.broadcast(torch.cat([which, sums]), what=f"weight sync bucket {index} checksums"))
        return works

    def close(self) -> None:
        self._buffers = []
