"""Deterministic packing of a tensor stream into flat byte buckets.

Sender and receivers run the same packer over the same (name, dtype, shape) sequence, so they agree on every
bucket's content without talking. Each bucket's layout has a digest the sender announces before the bucket (see
``wire.py``): a receiver whose metadata differs from the sender's stream fails on the first wrong bucket, before
receiving or loading it.

Placement: tensors go one after the other at aligned offsets; one that does not fit the current bucket opens the
next; one larger than a whole bucket is split at byte boundaries across as many buckets as it needs (only when
``split_large``; otherwise it gets a bucket of its own size).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import ConfigError
from .meta import TensorMeta

ALIGN = 64  # every tensor starts on a 64-byte boundary (element-aligned for every dtype, cache-line friendly)
MIN_BUCKET_BYTES = 1024


@dataclass(frozen=True)
class Piece:
    """Bytes ``[tensor_offset, tensor_offset + nbytes)`` of tensor ``index``, at ``bucket_offset`` of ``bucket``."""

    bucket: int
    index: int
    meta: TensorMeta
    bucket_offset: int
    tensor_offset: int
    nbytes: int

    @property
    def whole(self) -> bool:
        return self.tensor_offset == 0 and self.nbytes == self.meta.nbytes

    @property
    def completes(self) -> bool:
        """This piece is the tensor's last: after it, the tensor is whole at the receiver."""
        return self.tensor_offset + self.nbytes == self.meta.nbytes


@dataclass
class Bucket:
    index: int
    capacity: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes actually used: what goes over the wire."""
        return used_bytes(self.pieces)

    def digest(self) -> int:
        return layout_digest(self.index, self.pieces)


def used_bytes(pieces: list[Piece]) -> int:
    return max([0] + [p.bucket_offset + p.nbytes for p in pieces])


def layout_digest(index: int, pieces: list[Piece]) -> int:
    """A signed 64-bit digest of a bucket's layout (process-independent, unlike ``hash``)."""
    text = repr(
        [
            (index, p.index, p.meta.name, p.meta.dtype, p.meta.shape, p.bucket_offset, p.tensor_offset, p.nbytes)
            for p in pieces
        ]
    )
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class BucketPacker:
    """Online packer: feed metas in stream order, get the pieces (with their bucket index) to write."""

    def __init__(self, bucket_bytes: int, *, split_large: bool = True):
        check_bucket_bytes(bucket_bytes)
        self.bucket_bytes = bucket_bytes
        self.split_large = split_large
        self.bucket = 0
        self.used = 0
        self.filled = False  # the current bucket holds at least one piece
        self.count = 0

    def add(self, meta: TensorMeta) -> list[Piece]:
        index, self.count = self.count, self.count + 1
        size = meta.nbytes
        start = _align(self.used)
        if start + size <= self.bucket_bytes:
            return [self._place(index, meta, start, 0, size)]
        if size <= self.bucket_bytes or not self.split_large:
            self._next_bucket()
            return [self._place(index, meta, 0, 0, size)]
        pieces, done = [], 0
        if start >= self.bucket_bytes:  # no room left at all in this bucket
            self._next_bucket()
            start = 0
        while done < size:
            n = min(size - done, self.bucket_bytes - start)
            pieces.append(self._place(index, meta, start, done, n))
            done += n
            if done < size:
                self._next_bucket()
                start = 0
        return pieces

    def _place(self, index: int, meta: TensorMeta, offset: int, tensor_offset: int, n: int) -> Piece:
        self.used = offset + n
        self.filled = True
        return Piece(self.bucket, index, meta, offset, tensor_offset, n)

    def _next_bucket(self) -> None:
        if self.filled:
            self.bucket += 1
        self.used, self.filled = 0, False


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int, *, split_large: bool = True) -> list[Bucket]:
    """The buckets a sender with the same ``bucket_bytes`` produces for a stream with these metas, in order."""
    packer = BucketPacker(bucket_bytes, split_large=split_large)
    buckets: list[Bucket] = []
    for meta in metas:
        for piece in packer.add(meta):
            if not buckets or buckets[-1].index != piece.bucket:
                buckets.append(Bucket(piece.bucket, max(bucket_bytes, piece.nbytes)))
            buckets[-1].pieces.append(piece)
    return buckets


def check_bucket_bytes(bucket_bytes: int) -> None:
    if not isinstance(bucket_bytes, int) or bucket_bytes < MIN_BUCKET_BYTES:
        raise ConfigError(
            "bucket_bytes",
            f"must be an int of at least {MIN_BUCKET_BYTES}, got {bucket_bytes!r}.",
            "Use e.g. 512 << 20 (weight_sync_bucket_mb=512).",
        )
