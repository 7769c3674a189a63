"""Rank 0 of the weight-sync group: packs named tensors into flat buckets and broadcasts them.

Two bucket buffers alternate (double buffering): while one is on the wire, the next is being packed. The stream of
tensors may be lazy (ZeRO-3 gathers one parameter at a time and frees it when the generator advances); each
tensor's bytes are copied into the bucket before the next one is asked for.

With ``verify`` (the default) each bucket is followed by one checksum per piece (``verify.py``), computed on the
device after the payload was put on the wire, so the reduction overlaps the transfer.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from ..errors import ConfigError
from ..stats import TransferStats
from .buckets import BucketPacker, Piece, check_bucket_bytes, used_bytes
from .group import PendingWork, SyncGroup
from .meta import TensorMeta
from .verify import bucket_checksums
from .wire import end_tensor, handshake_tensor, header_tensor, tensor_bytes

DEFAULT_BUCKET_BYTES = 512 << 20


class WeightSender:
    """Sends a stream of ``(name, tensor)`` to every other rank of ``group`` (which must be rank 0 here).

    The buffers (2 x ``bucket_bytes`` on the group's device) are kept between ``send`` calls; ``close()`` frees them.
    ``verify``: send every piece's checksum, so the receivers check what they loaded (the receivers follow the
    handshake).
    """

    def __init__(self, group: SyncGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, verify: bool = True):
        check_bucket_bytes(bucket_bytes)
        if group.rank != 0:
            raise ConfigError("rank", f"the weight sender must be rank 0 of the sync group, this is rank {group.rank}.",
                              "Create the sender on the trainer's rank 0; engine workers use WeightReceiver.")
        self.group, self.bucket_bytes, self.verify = group, bucket_bytes, verify
        self._buffers: list[torch.Tensor] = []

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> TransferStats:
        """Broadcast every tensor; returns the payload bytes and the time from the first byte to the last delivered."""
        g = self.group
        g.broadcast(handshake_tensor(self.bucket_bytes, g.device, verify=self.verify),
                    what="weight sync handshake").wait()
        if not self._buffers:
            self._buffers = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=g.device) for _ in range(2)]
        start = time.perf_counter()
        packer = BucketPacker(self.bucket_bytes)
        inflight: list[list[PendingWork]] = [[], []]
        pieces: list[Piece] = []
        payload = 0
        on_device = g.device.type == "cuda"  # async copies only into device buckets (a host bucket is read at once)
        with torch.no_grad():
            for name, tensor in named_tensors:
                meta = TensorMeta.of(name, tensor)
                src = tensor_bytes(tensor)
                payload += meta.nbytes
                for piece in packer.add(meta):
                    if pieces and piece.bucket != pieces[0].bucket:
                        inflight[pieces[0].bucket % 2] = self._flush(pieces)
                        pieces = []
                    if not pieces:  # opening a bucket: its buffer must be off the wire
                        for work in inflight[piece.bucket % 2]:
                            work.wait()
                        inflight[piece.bucket % 2] = []
                    buf = self._buffers[piece.bucket % 2]
                    buf[piece.bucket_offset:piece.bucket_offset + piece.nbytes].copy_(
                        src[piece.tensor_offset:piece.tensor_offset + piece.nbytes], non_blocking=on_device)
                    pieces.append(piece)
            if pieces:
                inflight[pieces[0].bucket % 2] = self._flush(pieces)
            n_buckets = pieces[0].bucket + 1 if pieces else 0
            end = g.broadcast(end_tensor(n_buckets, g.device), what="weight sync end")
            for work in [*inflight[0], *inflight[1], end]:
                work.wait()
        if g.device.type == "cuda":
            torch.cuda.current_stream(g.device).synchronize()
        return TransferStats(payload, time.perf_counter() - start, "weight sync")

    def _flush(self, pieces: list[Piece]) -> list[PendingWork]:
        """Announce the bucket's layout, then put its bytes on the wire, then its checksums (all asynchronous, in this
        order; the checksums are computed while the payload is on the wire)."""
        index = pieces[0].bucket
        g = self.group
        header = g.broadcast(header_tensor(index, pieces, g.device), what=f"weight sync bucket {index} header")
        buf = self._buffers[index % 2]
        works = [header, g.broadcast(buf[:used_bytes(pieces)], what=f"weight sync bucket {index}")]
        if self.verify:
            works.append(g.broadcast(bucket_checksums(buf, pieces), what=f"weight sync bucket {index} checksums"))
        return works

    def close(self) -> None:
        self._buffers = []
